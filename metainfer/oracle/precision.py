"""The reference at a chosen compute precision, on the weights it already holds.

The judge compares the engine with the exact function its weights define, and measures how far an
honest low-precision implementation lands from that function on the same prompts:

- `exact`: transformers' forward computed in float32 on the stored (BF16) weights: every low-precision
  tensor an op receives is widened first, every request for a low-precision result is answered in
  float32. No second copy of the weights exists (each op widens only what it reads), so this fits
  beside the engine on one GPU where a float32 model (4 bytes a weight) would not.
- `bf16`: the same forward as transformers runs it natively in BF16: the reference's own rounding.
- `fp8`: `exact` with the published FP8 format applied on the fly: the weights of the quantised
  projections rounded to e4m3 in 128 x 128 blocks (scale = block amax / 448), and their inputs
  rounded to e4m3 in groups of 128 per token. What an honest FP8 engine computes, up to kernel order.

The engine's error against `exact`, over the reference's own error (`bf16` or `fp8`) against
`exact`, is the figure the BF16 and FP8 gates judge: a ratio, so the same gate holds on peaked dummy
weights and on a trained model, and an error of one layer cannot hide in a fixed absolute allowance.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

LOW = (torch.bfloat16, torch.float16)
E4M3_MAX = 448.0
BLOCK = 128
# projections the published FP8 checkpoint stores in e4m3 (router, gates, norms, embeddings,
# lm_head and the DeltaNet in_proj_a / in_proj_b, conv, A_log, dt_bias stay BF16)
FP8_SUFFIXES = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_z.weight",
    "linear_attn.out_proj.weight",
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
    "mlp.shared_expert.gate_proj.weight",
    "mlp.shared_expert.up_proj.weight",
    "mlp.shared_expert.down_proj.weight",
)
SDPA_CHUNK = 512  # query rows per attention call in float32: [rows, keys, heads] scores, not [L, L, heads]
_PASS = {torch.Tensor.__getitem__}  # indexing computes nothing: widen the slice, not the whole
_INPLACE = {torch.Tensor.__setitem__}


def _widen(x):
    if isinstance(x, torch.Tensor) and x.dtype in LOW:
        return x.float()
    if isinstance(x, torch.dtype) and x in LOW:
        return torch.float32
    return x


class Float32Compute(TorchFunctionMode):
    """Every op computes in float32: low-precision tensor arguments are widened, low-precision dtypes
    asked for are replaced by float32. In-place ops on a low-precision tensor keep its dtype (writing
    into a widened copy would lose the write)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PASS or getattr(func, "__name__", "") == "__get__":
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        inplace = func in _INPLACE or (name.endswith("_") and not name.startswith("__"))
        if inplace and args and isinstance(args[0], torch.Tensor) and args[0].dtype in LOW:
            return func(*args, **kwargs)
        args, kwargs = tree_map(_widen, (args, kwargs))
        if func is F.scaled_dot_product_attention:
            return _chunked_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def _chunked_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    """`F.scaled_dot_product_attention` over SDPA_CHUNK query rows at a time (each row's softmax is
    its own: the same function, in a fraction of the memory a float32 score matrix of a 32k-token
    prompt needs). A causal call is given each chunk's causal mask, and keys up to the chunk's end."""
    lq, lk = query.shape[-2], key.shape[-2]
    if lq <= SDPA_CHUNK or dropout_p or (is_causal and lq != lk):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            **kw,
        )
    out = []
    for q0 in range(0, lq, SDPA_CHUNK):
        q1 = min(lq, q0 + SDPA_CHUNK)
        if is_causal:
            m = torch.ones(q1 - q0, q1, dtype=torch.bool, device=query.device).tril(q0)
            k, v = key[..., :q1, :], value[..., :q1, :]
        else:
            m = attn_mask
            if attn_mask is not None and attn_mask.shape[-2] > 1:
                m = attn_mask[..., q0:q1, :]
            k, v = key, value
        out.append(F.scaled_dot_product_attention(query[..., q0:q1, :], k, v, attn_mask=m, scale=scale, **kw))
    return torch.cat(out, dim=-2)


def fake_e4m3_blocks(w: torch.Tensor) -> torch.Tensor:
    """[..., N, K] float -> the same values rounded to e4m3 with one scale per 128 x 128 block."""
    *lead, n, k = w.shape
    pn, pk = -n % BLOCK, -k % BLOCK
    x = F.pad(w.float(), (0, pk, 0, pn)).reshape(*lead, (n + pn) // BLOCK, BLOCK, (k + pk) // BLOCK, BLOCK)
    amax = x.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-12)
    s = amax / E4M3_MAX
    q = (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    return q.reshape(*lead, n + pn, k + pk)[..., :n, :k]


def fake_e4m3_groups(x: torch.Tensor) -> torch.Tensor:
    """[..., K] activations rounded to e4m3 with one scale per 128 consecutive values of a row."""
    k = x.shape[-1]
    pk = -k % BLOCK
    g = F.pad(x.float(), (0, pk)).reshape(*x.shape[:-1], (k + pk) // BLOCK, BLOCK)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    q = (g / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    return q.reshape(*x.shape[:-1], k + pk)[..., :k]


class FakeFP8(Float32Compute):
    """Float32 compute with the quantised projections' weights and inputs rounded as FP8 stores them.
    `storages`: the data pointers of the parameters the FP8 format quantises (a slice of a fused
    expert tensor is recognised by its storage)."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            w = args[1]
            if w.untyped_storage().data_ptr() in self.storages:
                x = fake_e4m3_groups(args[0].float())
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return F.linear(x, fake_e4m3_blocks(w), None if bias is None else bias.float())
        return super().__torch_function__(func, types, args, kwargs)


def fp8_storages(model: torch.nn.Module) -> set[int]:
    return {
        p.untyped_storage().data_ptr() for n, p in model.named_parameters() if n.endswith(FP8_SUFFIXES)
    }


@contextmanager
def _eager_experts(model: torch.nn.Module) -> Iterator[None]:
    """The experts as transformers' per-expert loop of `F.linear` (grouped kernels may not take
    float32, and the FP8 rounding is applied per `F.linear`)."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    saved = {k: getattr(c, "_experts_implementation", None) for k, c in configs.items()}
    for c in configs.values():
        if hasattr(c, "_experts_implementation"):
            c._experts_implementation = "eager"
    try:
        yield
    finally:
        for k, c in configs.items():
            if saved[k] is not None:
                c._experts_implementation = saved[k]


@contextmanager
def compute(model: torch.nn.Module, mode: str) -> Iterator[None]:
    """mode: exact | fp8 | native (the model's own dtype and implementations, nothing changed)."""
    if mode == "native":
        yield
        return
    if mode not in ("exact", "fp8"):
        raise ValueError(f"unknown compute mode {mode!r}")
    fn = Float32Compute() if mode == "exact" else FakeFP8(fp8_storages(model))
    with _eager_experts(model), fn:
        yield


def is_low_precision(model: torch.nn.Module) -> bool:
    return next(model.parameters()).dtype in LOW


@torch.inference_mode()
def reference_logits(reference, token_ids: Sequence[int], mode: str, keep: int | None = None) -> torch.Tensor:
    """[L, V] (or the last `keep` rows) fp32 logits of `reference` (metainfer.oracle.reference.Reference)
    computed in `mode`; row i predicts token i + 1."""
    model = reference.model
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=reference.device)
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with compute(model, mode):
            kw = {"logits_to_keep": keep} if keep else {}
            out = model(input_ids=ids, use_cache=False, **kw)
        return out.logits[0].float()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


@torch.inference_mode()
def reference_logits_batch(reference, seqs: Sequence[Sequence[int]], mode: str) -> list[torch.Tensor]:
    """`reference_logits` of several sequences in one forward: [L_i, V] fp32 each.

    The sequences are right-padded to the longest. Every layer of the model is causal (attention,
    the DeltaNet recurrence and its causal convolution) or per-token (norms, MoE routing, experts),
    so a real position never sees a pad and its logits are those of the sequence alone, up to the
    summation order of the wider matmuls (float32 round-off)."""
    if not seqs:
        return []
    model = reference.model
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with compute(model, mode):
            out = model(input_ids=ids.to(reference.device), use_cache=False)
        logits = out.logits
        return [logits[i, : len(s)].float() for i, s in enumerate(seqs)]
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
