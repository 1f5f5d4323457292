"""Layer by layer: what each decoder layer adds to the residual stream, the engine's against the
reference's, so a fault is localised to the layer it enters, and an error confined to one layer is
measured against that layer's own contribution, not after 40 layers have diluted it.

The engine hands over its residual stream through `Qwen3_5MoeModel.layer_hook` (teacher-forced
scoring, eager steps); the reference's comes from transformers' `output_hidden_states` (entry 0 is
the embedding, entry i + 1 the stream after layer i; the last entry is final-normed, so the last layer
is judged through the logits instead). A layer's contribution is the stream after it minus the stream
before it. Low precision: each layer's rel. error against the exact (float32-compute) reference over
the reference's own rel. error at that precision, on the same rows.
"""

from __future__ import annotations

import math

import torch

from metainfer.oracle.compare import Check, Gates
from metainfer.oracle.precision import compute

PROMPTS = 2  # fresh random prompts, scored one at a time (one request, one eager chunk)
FLOOR = 1e-6  # a reference noise below this is exact agreement: the ratio uses it instead


def _fresh_prompts(suite, vocab: int, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(suite.seed * 7919 + 101)
    length = max(2, min(48, suite.chunk_tokens))
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]


@torch.inference_mode()
def _reference_stream(reference, ids: list[int], mode: str) -> list[torch.Tensor]:
    """[L, H] fp32: the embedding, then the stream after layers 0 .. n-2 (before the final norm)."""
    model = reference.model
    x = torch.tensor([ids], dtype=torch.long, device=reference.device)
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with compute(model, mode):
            out = model(input_ids=x, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    return [h[0].float() for h in out.hidden_states[:-1]]


def _engine_stream(llm, ids: list[int], n_layers: int) -> tuple[list[torch.Tensor] | None, str]:
    model = llm.engine.runner.model
    got: dict[int, list[torch.Tensor]] = {}

    def hook(i: int, x, residual) -> None:
        if isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor):
            got.setdefault(i, []).append((x.float() + residual.float()).clone())

    model.layer_hook = hook
    try:
        llm.score([ids])
    finally:
        model.layer_hook = None
    rows = [torch.cat(got[i]) if i in got else None for i in range(n_layers)]
    if any(r is None or r.shape[0] != len(ids) for r in rows):
        got_rows = [0 if r is None else r.shape[0] for r in rows]
        return None, f"layer hook delivered {got_rows} rows of {len(ids)}"
    return rows, ""


def layer_checks(llm, reference, suite, gates: Gates) -> tuple[list[Check], dict]:
    """Check `layers.rel_err` (float32: each layer's contribution within rel. error gates.rel_rmse)
    or `layers.noise_rmse` (low precision: each layer's error over the reference's own <=
    gates.layer_ratio). Figures: per layer, the engine's and the noise's rel. error, the first
    layer over."""
    n_layers = len(llm.engine.runner.model.layers) - 1
    vocab = int(reference.model.config.vocab_size)
    sq_e = [0.0] * n_layers
    sq_n = [0.0] * n_layers
    sq_r = [0.0] * n_layers
    problems = []
    for ids in _fresh_prompts(suite, min(vocab, 248044), PROMPTS):
        eng, why = _engine_stream(llm, ids, n_layers)
        if eng is None:
            problems.append(why)
            continue
        exact = [x.double() for x in _reference_stream(reference, ids, "exact")]
        eng = [exact[0]] + [x.to(exact[0].device).double() for x in eng]  # the same embedding lookup
        noise = _reference_stream(reference, ids, gates.noise_mode) if gates.noise_mode else None
        noise = None if noise is None else [x.to(exact[0].device).double() for x in noise]
        for i in range(n_layers):
            ex = exact[i + 1] - exact[i]  # layer i's contribution [L, H]
            sq_e[i] += float((eng[i + 1] - eng[i] - ex).square().sum())
            sq_r[i] += float(ex.square().sum())
            if noise is not None:
                sq_n[i] += float((noise[i + 1] - noise[i] - ex).square().sum())
    err = [math.sqrt(e / r) if r > 0 else math.nan for e, r in zip(sq_e, sq_r)]
    fig: dict = {"layers": n_layers, "prompts": PROMPTS, "engine_rel_err": err, "problems": problems}
    if problems or n_layers == 0:
        detail = "; ".join(problems) or "no layer to judge"
        return [Check("layers.delivered", None, "every layer's rows", False, detail)], fig
    if gates.noise_mode and gates.layer_ratio is not None:
        nz = [math.sqrt(n / r) if r > 0 else math.nan for n, r in zip(sq_n, sq_r)]
        ratio = [e / max(n, FLOOR) for e, n in zip(err, nz)]
        fig.update(noise_rel_err=nz, ratio=ratio)
        limit, values, what = gates.layer_ratio, ratio, "error / the reference's own"
    else:
        limit, values, what = gates.rel_rmse, err, "rel. error"
    over = [i for i, v in enumerate(values) if not v <= limit]
    worst = max(range(n_layers), key=lambda i: values[i] if not math.isnan(values[i]) else math.inf)
    fig["first_layer_over"] = over[0] if over else None
    detail = (
        f"first layer over: {over[0]} ({what} {values[over[0]]:.3g}); worst layer {worst}"
        if over
        else f"worst layer {worst}: {what} {values[worst]:.3g} over {n_layers} layers"
    )
    name = "layers.noise_rmse" if gates.noise_mode else "layers.rel_err"
    return [Check(name, float(values[worst]), f"<= {limit:.3g} at every layer", not over, detail)], fig
