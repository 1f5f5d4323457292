"""`ops.step_plan` against the paths the model took before the plan, when ops returned None to mean "try
the next path": the plan's choices and the model's launches, on the CPU with the kernels off, on (CPU
tensors: the references) and with the GPU dispatch emulated (recording stubs with reference math, in place
of the registry's kernels)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from metainfer.config import FULL, LINEAR, ModelConfig
from metainfer.forward_meta import CacheTensors, ForwardMeta
from metainfer.kernels import fp8_linear, norm, ops, weight_stream
from metainfer.kernels import reference as ref
from metainfer.model.fp8 import quantize_model_fp8
from metainfer.model.weights import build_model, init_dummy

CFG = dict(  # both layer kinds and their transitions; DeltaNet heads of 128 (the FP8 gated-norm prologue)
    vocab_size=256, hidden_size=64, num_hidden_layers=5, layer_types=(LINEAR, FULL, LINEAR, LINEAR, FULL),
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0, partial_rotary_factor=0.25,
    linear_num_key_heads=1, linear_key_head_dim=32, linear_num_value_heads=2, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, mtp_num_hidden_layers=1,
)
T_GRID = (1, 2, 4, 5, 8, 9, 16, 17, 32, 128, 1000)
LAYOUTS = ("decode", "prefill", "mixed")  # T decodes; a prompt of T tokens; a decode and T - 1 prompt tokens
GPU_MODES = ("gpu", "gpu+cublas")  # kernels on CUDA: without / with cuBLAS's blockwise FP8 GEMM and gemv.cu

# The chains' choices (the model before the plan), per GPU emulation, FP8, layout, layer kind and fused
# shared expert: one code per T of T_GRID ("-": no such step), its letters the plan's input_norm
# (Prologue / Copy / Norm), moe_norm (Router / Copy / Norm), moe (routed / pair / grouped / experts) and
# out_norm (Prologue / Copy / Norm). "gpu": gemv.cu declines every operand (then the norm, then the
# projection: as on GPUs before sm_90); "gpu+cublas": norms copy past 16 tokens, gemv.cu takes the
# prologue. Derived once from the model at commit 1e907d9, the last with the chains: this file's `emulate`,
# `run`, `_choices` and `_digest` over the grid, with that commit's metainfer first on the path.
CHAINS = {
    ("gpu", False, "decode", LINEAR, True): "NRpP NRpN NRpN NRpN NRpN NNgN NNgN NNgN NNgN NNgN NNgN",
    ("gpu", False, "decode", FULL, True): "NRpN NRpN NRpN NRpN NRpN NNgN NNgN NNgN NNgN NNgN NNgN",
    ("gpu", False, "prefill", LINEAR, True): "NRpP NRpN NRpN NRpN NRpN NNgN NNgN NNgN NNgN NNgN NNgN",
    ("gpu", False, "prefill", FULL, True): "NRpN NRpN NRpN NRpN NRpN NNgN NNgN NNgN NNgN NNgN NNgN",
    ("gpu", False, "mixed", LINEAR, True): "- NRpN NRpN NRpN NRpN NNgN NNgN NNgN NNgN NNgN NNgN",
    ("gpu", False, "mixed", FULL, True): "- NRpN NRpN NRpN NRpN NNgN NNgN NNgN NNgN NNgN NNgN",
    ("gpu", False, "decode", LINEAR, False): "NReP NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu", False, "decode", FULL, False): "NReN NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu", False, "prefill", LINEAR, False): "NReP NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu", False, "prefill", FULL, False): "NReN NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu", False, "mixed", LINEAR, False): "- NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu", False, "mixed", FULL, False): "- NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu", True, "decode", LINEAR, True): "PRrP NRrN NRrN NRpN NRpN NNpN NNpN NNgN NNgN NNgN NNgN",
    ("gpu", True, "decode", FULL, True): "PRrN NRrN NRrN NRpN NRpN NNpN NNpN NNgN NNgN NNgN NNgN",
    ("gpu", True, "prefill", LINEAR, True): "PRrP NRrN NRrN NRpN NRpN NNpN NNpN NNgN NNgN NNgN NNgN",
    ("gpu", True, "prefill", FULL, True): "PRrN NRrN NRrN NRpN NRpN NNpN NNpN NNgN NNgN NNgN NNgN",
    ("gpu", True, "mixed", LINEAR, True): "- NRrN NRrN NRpN NRpN NNpN NNpN NNgN NNgN NNgN NNgN",
    ("gpu", True, "mixed", FULL, True): "- NRrN NRrN NRpN NRpN NNpN NNpN NNgN NNgN NNgN NNgN",
    ("gpu", True, "decode", LINEAR, False): "NReP NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu", True, "decode", FULL, False): "NReN NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu", True, "prefill", LINEAR, False): "NReP NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu", True, "prefill", FULL, False): "NReN NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu", True, "mixed", LINEAR, False): "- NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu", True, "mixed", FULL, False): "- NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu+cublas", False, "decode", LINEAR, True): "NRpP NRpN NRpN NRpN NRpN NNgN NNgN NNgN NNgN NNgN NNgN",
    ("gpu+cublas", False, "decode", FULL, True): "NRpN NRpN NRpN NRpN NRpN NNgN NNgN NNgN NNgN NNgN NNgN",
    ("gpu+cublas", False, "prefill", LINEAR, True): "NRpP NRpN NRpN NRpN NRpN NNgN NNgN NNgN NNgN NNgN NNgN",
    ("gpu+cublas", False, "prefill", FULL, True): "NRpN NRpN NRpN NRpN NRpN NNgN NNgN NNgN NNgN NNgN NNgN",
    ("gpu+cublas", False, "mixed", LINEAR, True): "- NRpN NRpN NRpN NRpN NNgN NNgN NNgN NNgN NNgN NNgN",
    ("gpu+cublas", False, "mixed", FULL, True): "- NRpN NRpN NRpN NRpN NNgN NNgN NNgN NNgN NNgN NNgN",
    ("gpu+cublas", False, "decode", LINEAR, False): "NReP NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu+cublas", False, "decode", FULL, False): "NReN NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu+cublas", False, "prefill", LINEAR, False): "NReP NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu+cublas", False, "prefill", FULL, False): "NReN NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu+cublas", False, "mixed", LINEAR, False): "- NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu+cublas", False, "mixed", FULL, False): "- NReN NReN NReN NReN NNeN NNeN NNeN NNeN NNeN NNeN",
    ("gpu+cublas", True, "decode", LINEAR, True): "PRrP NRrN NRrN NRpN NRpN NNpN NNpN NCgC NCgC NCgC NCgC",
    ("gpu+cublas", True, "decode", FULL, True): "PRrN NRrN NRrN NRpN NRpN NNpN NNpN CCgN CCgN CCgN CCgN",
    ("gpu+cublas", True, "prefill", LINEAR, True): "PRrP NRrN NRrN NRpN NRpN NNpN NNpN CCgC CCgC CCgC CCgC",
    ("gpu+cublas", True, "prefill", FULL, True): "PRrN NRrN NRrN NRpN NRpN NNpN NNpN CCgN CCgN CCgN CCgN",
    ("gpu+cublas", True, "mixed", LINEAR, True): "- NRrN NRrN NRpN NRpN NNpN NNpN NCgC NCgC NCgC NCgC",
    ("gpu+cublas", True, "mixed", FULL, True): "- NRrN NRrN NRpN NRpN NNpN NNpN CCgN CCgN CCgN CCgN",
    ("gpu+cublas", True, "decode", LINEAR, False): "NReP NReN NReN NReN NReN NNeN NNeN NNeC NNeC NNeC NNeC",
    ("gpu+cublas", True, "decode", FULL, False): "NReN NReN NReN NReN NReN NNeN NNeN CNeN CNeN CNeN CNeN",
    ("gpu+cublas", True, "prefill", LINEAR, False): "NReP NReN NReN NReN NReN NNeN NNeN CNeC CNeC CNeC CNeC",
    ("gpu+cublas", True, "prefill", FULL, False): "NReN NReN NReN NReN NReN NNeN NNeN CNeN CNeN CNeN CNeN",
    ("gpu+cublas", True, "mixed", LINEAR, False): "- NReN NReN NReN NReN NNeN NNeN NNeC NNeC NNeC NNeC",
    ("gpu+cublas", True, "mixed", FULL, False): "- NReN NReN NReN NReN NNeN NNeN CNeN CNeN CNeN CNeN",
}
# sha1 (12 hex digits) of the launch sequence over T_GRID (`_digest`), derived as CHAINS
DIGESTS = {
    ("gpu", False, "decode", True): "f8c389784354",
    ("gpu", False, "prefill", True): "aef7caa93439",
    ("gpu", False, "mixed", True): "91ef65cf900c",
    ("gpu", False, "decode", False): "0dc05a283dd5",
    ("gpu", False, "prefill", False): "ed15682ccc78",
    ("gpu", False, "mixed", False): "cc9049f8fe9c",
    ("gpu", True, "decode", True): "4e7db7976578",
    ("gpu", True, "prefill", True): "d085f370901b",
    ("gpu", True, "mixed", True): "4fcacc1045dc",
    ("gpu", True, "decode", False): "eca4ddffc552",
    ("gpu", True, "prefill", False): "c13020852aeb",
    ("gpu", True, "mixed", False): "3f9d07d15ee2",
    ("gpu+cublas", False, "decode", True): "f8c389784354",
    ("gpu+cublas", False, "prefill", True): "aef7caa93439",
    ("gpu+cublas", False, "mixed", True): "91ef65cf900c",
    ("gpu+cublas", False, "decode", False): "0dc05a283dd5",
    ("gpu+cublas", False, "prefill", False): "ed15682ccc78",
    ("gpu+cublas", False, "mixed", False): "cc9049f8fe9c",
    ("gpu+cublas", True, "decode", True): "f65d5e33596d",
    ("gpu+cublas", True, "prefill", True): "a9fcfa06f5ce",
    ("gpu+cublas", True, "mixed", True): "a799062e1e3f",
    ("gpu+cublas", True, "decode", False): "6b0535060758",
    ("gpu+cublas", True, "prefill", False): "72cedeb258e0",
    ("gpu+cublas", True, "mixed", False): "6789caf317d9",
}

STATE: dict = {"active": False, "events": [], "gemv": False, "where": ""}


def _record(name: str, x, kw: dict, declined: bool = False) -> None:
    T = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else -1
    flags = tuple(sorted(k for k, v in kw.items() if v is not None and v is not False and k != "res_out"))
    if not (declined and name in ("add_rms_norm_router", "gated_norm_linear")):  # (no launch)
        STATE["events"].append((STATE["where"], name, T, flags, declined))


def _inactive(fn, *a, **kw):
    STATE["active"] = False
    try:
        return fn(*a, **kw)
    finally:
        STATE["active"] = True


def _deq(w, s, dtype):
    return w if s is None else ops.ref_dequant_fp8(w, s, dtype)


def _through(op: str, drop: tuple[str, ...] = ()):
    def stub(*a, **kw):
        _record(op, a[0], kw)
        return _inactive(getattr(ops, op), *a, **{k: v for k, v in kw.items() if k not in drop})
    return stub


def _route(logits, top_k, shared=False):
    _record("route", logits, {"shared": shared})
    return ref.route_with_shared(logits, top_k) if shared else ref.route(logits, top_k)


def _rows(name: str, x, w_gu, w_dn, ids, gs, ds, kw: dict):
    _record(name, x, kw)
    return ref.moe_expert_rows(x, _deq(w_gu, gs, x.dtype), _deq(w_dn, ds, x.dtype), ids)


def _routed_rows(x, logits, top_k, shared, w_gu, w_dn, gs=None, ds=None):
    weights, ids = ref.route_with_shared(logits, top_k) if shared else ref.route(logits, top_k)
    return _rows("moe_routed_rows", x, w_gu, w_dn, ids, gs, ds, {}), weights


def _pair_rows(x, w_gu, w_dn, ids, gs=None, ds=None):
    return _rows("moe_pair_rows", x, w_gu, w_dn, ids, gs, ds, {})


def _grouped_rows(x, w_gu, w_dn, ids, gs=None, ds=None, xq=None):
    return _rows("moe_grouped_rows", x, w_gu, w_dn, ids, gs, ds, {"xq": xq}).to(x.dtype)


def _norm_router(x, residual, weight, eps, router_weight):
    """The kernel's own refusals before the plan (None), then the reference."""
    declined = (not 0 < x.shape[0] <= norm.ROUTER_MAX_T or x.dtype not in norm._TL_DTYPE or x.stride(1) != 1
                or residual.stride(-1) != 1 or router_weight.dtype != x.dtype
                or not router_weight.is_contiguous() or router_weight.shape[1] != x.shape[1])
    _record("add_rms_norm_router", x, {}, declined)
    if declined:
        return None
    out, new_res = ref.add_rms_norm(x, residual, weight, eps)
    return out, new_res, F.linear(out, router_weight)


def _gnorm_linear(core, z, norm_weight, eps, weight, scale_inv):
    """The kernel's own refusals before the plan (None), then the reference."""
    T, Hv, D = core.shape
    N, K = weight.shape
    fp8 = scale_inv is not None
    cfg = weight_stream.gnorm_config(N, Hv, fp8)
    declined = (not 0 < T <= weight_stream.GNORM_MAX_T or K != Hv * D or z.shape != core.shape or D & (D - 1)
                or core.stride(2) != 1 or z.stride(2) != 1 or (fp8 and D != 128)
                or (not fp8 and weight.dtype != core.dtype) or not weight.is_contiguous()
                or Hv % cfg["HEADS"] or cfg["HEADS"] & (cfg["HEADS"] - 1) or 128 % cfg["BLOCK_N"])
    _record("gated_norm_linear", core, {}, declined)
    if declined:
        return None
    return F.linear(ref.gated_rms_norm(core, z, norm_weight, eps).reshape(T, Hv * D), _deq(weight, scale_inv,
                                                                                            core.dtype))


def _pending_linear(rows, tw, residual, norm_weight, eps, new_res, w, s, conv=None):
    """gemv.cu's prologue: declined (None) in "gpu", the reference in "gpu+cublas"."""
    _record("pending_norm_linear", rows, {"conv": conv}, not STATE["gemv"])
    if not STATE["gemv"]:
        return None
    h = _inactive(ops.moe_add_rms_norm, rows, tw, residual, norm_weight, eps, residual.dtype,
                  res_out=new_res)[0]
    return _inactive(ops.linear_conv_update, h, w, s, *conv) if conv else _inactive(ops.fp8_linear, h, w, s)


STUBS = {
    **{op: _through(op) for op in ("rms_norm", "causal_conv1d_update", "causal_conv1d", "gdn_decode",
                                   "gdn_decode_gated", "gdn_prefill_varlen", "paged_attention",
                                   "qk_norm_rope_write", "moe_experts", "linear", "linear_conv_update")},
    "add_rms_norm": _through("add_rms_norm", ("xq_out",)),
    "gated_rms_norm": _through("gated_rms_norm", ("xq_out",)),
    "moe_add_rms_norm": _through("moe_add_rms_norm", ("xq_out",)),
    "fp8_linear": _through("fp8_linear", ("xq",)),
    "route": _route,
    "moe_routed_rows": _routed_rows,
    "moe_pair_rows": _pair_rows,
    "moe_grouped_rows": _grouped_rows,
    "add_rms_norm_router": _norm_router,
    "gated_norm_linear": _gnorm_linear,
    "pending_norm_linear": _pending_linear,
}


def emulate(mp: pytest.MonkeyPatch, mode: str) -> None:
    """ops as on a CUDA device in `mode` ("off", "on": the CPU's, or a GPU_MODES emulation)."""
    if mode == "off":
        mp.setattr(ops, "_ENABLED", False)
        return
    if mode == "on":
        mp.setattr(ops, "_ENABLED", ops._ENABLED)  # both restored after the test
        mp.setattr(ops, "_KERNELS", dict(ops._KERNELS))
        ops.use_kernels(True)
        return
    mp.setattr(ops, "_ENABLED", True)
    mp.setattr(ops, "_KERNELS", dict(STUBS))
    mp.setattr(ops, "_kernel", lambda name, x: STUBS.get(name) if STATE["active"] else None)
    if hasattr(ops, "_serves"):
        mp.setattr(ops, "_serves", lambda name, device_type: STATE["active"] and name in STUBS)
    mp.setitem(STATE, "active", True)
    mp.setitem(STATE, "gemv", mode == "gpu+cublas")
    if mode == "gpu+cublas":
        mp.setattr(fp8_linear, "norm_quant_wanted", lambda T, device: T > weight_stream.FP8_STREAM_MAX_T)


_MODELS: dict = {}


def model(fp8: bool, fused: bool):
    if (fp8, fused) not in _MODELS:
        m = build_model(ModelConfig(**dict(CFG, shared_expert_intermediate_size=32 if fused else 48)),
                        torch.float32, "cpu")
        init_dummy(m, 0)
        if fp8:
            quantize_model_fp8(m)
        for i, layer in enumerate([*m.layers, *m.mtp.layers]):  # launches by layer (the MTP's: L5)
            layer.register_forward_pre_hook(lambda mod, args, i=i: STATE.__setitem__("where", f"L{i}"))
            layer.register_forward_hook(lambda mod, args, out: STATE.__setitem__("where", "between"))
        _MODELS[fp8, fused] = m
    return _MODELS[fp8, fused]


def layout(name: str, T: int) -> tuple[list[int], list[int]] | None:
    """(query lens, context lens) of a step of T tokens, decodes first; None where there is none."""
    if name == "decode":
        return [1] * T, [3] * T
    if name == "prefill":
        return [T], [0]
    return ([1, T - 1], [3, 0]) if T > 1 else None


@torch.inference_mode()
def run(m, qlens: list[int], ctx: list[int]) -> tuple[list, tuple[torch.Tensor, ...]]:
    """The model's forward and its MTP layer's over one step: (launches, outputs)."""
    c, bs, T = m.cfg, 16, sum(qlens)
    tables, nb = [], 1
    for q, n in zip(qlens, ctx):
        tables.append(list(range(nb, nb + -(-(q + n) // bs))))
        nb += len(tables[-1])
    slots = list(range(1, len(qlens) + 1))
    last = [sum(qlens[: i + 1]) - 1 for i in range(len(qlens))]
    meta = ForwardMeta.build(qlens, ctx, tables, slots, bs, last, "cpu")
    ids = torch.randint(0, c.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
    pos = torch.cat([torch.arange(n, n + q) for q, n in zip(qlens, ctx)])
    kv, ns = (nb, bs, c.num_key_value_heads, c.head_dim), len(slots) + 1
    caches = CacheTensors(
        k=[torch.zeros(kv) for _ in range(len(c.full_layer_ids) + 1)],
        v=[torch.zeros(kv) for _ in range(len(c.full_layer_ids) + 1)],
        conv=[torch.zeros(ns, c.linear_conv_kernel_dim - 1, c.linear_conv_dim) for _ in c.linear_layer_ids],
        ssm=[torch.zeros(ns, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
             for _ in c.linear_layer_ids],
    )
    STATE["events"] = []
    STATE["where"] = "between"
    h = m(ids, pos, meta, caches)
    out = m.mtp(m.embed_tokens(ids), h, pos, meta, caches)
    return STATE["events"], (h, out, caches.ssm[0], caches.k[0])


def _choices(events: list, kind: str, layer_types: tuple[str, ...]) -> str:
    """The plan code (see CHAINS) the launches of the layers of `kind` show (the input norm: of layers > 0;
    the MTP layer, L5, takes no residual)."""
    codes = set()
    for i, t in enumerate((*layer_types, FULL)):
        if t != kind:
            continue
        ev = [(n, fl, d) for w, n, _, fl, d in events if w == f"L{i}"]
        names = [n for n, _, _ in ev]
        first = ev[0]
        inp = "P" if "pending_norm_linear" in names else "C" if "xq_out" in first[1] else "N"
        post = [e for e in ev if e[0] in ("add_rms_norm", "add_rms_norm_router")][-1]
        mid = "R" if post[0] == "add_rms_norm_router" else "C" if "xq_out" in post[1] else "N"
        rows = (("moe_routed_rows", "r"), ("moe_pair_rows", "p"), ("moe_grouped_rows", "g"))
        moe = next((c for n, c in rows if n in names), "e")
        out = "N"
        if kind == LINEAR:
            out = "P" if "gated_norm_linear" in names else "C" if any(
                n == "gated_rms_norm" and "xq_out" in fl for n, fl, _ in ev) else "N"
        codes.add((inp if 0 < i < len(layer_types) else None, mid, moe, out))
    inputs = {c[0] for c in codes} - {None}
    assert len(inputs) <= 1 and len({c[1:] for c in codes}) == 1, codes  # one plan per kind
    c = next(iter(codes))
    return (inputs.pop() if inputs else "N") + "".join(c[1:])


def _digest(events: list) -> str:
    return hashlib.sha1(repr(events).encode()).hexdigest()[:12]


def _code(plan) -> str:
    short = dict(prologue="P", copy="C", norm="N", router="R", routed_rows="r", pair_rows="p",
                 grouped_rows="g", experts="e")
    return "".join(short[v] for v in (plan.input_norm, plan.moe_norm, plan.moe, plan.out_norm))


def _plan_code(m, kind: str, qlens: list[int]) -> str:
    layer = next(layer for layer in m.layers if layer.layer_type == kind)
    nd = next((i for i, q in enumerate(qlens) if q != 1), len(qlens))
    return _code(ops.step_plan(sum(qlens), nd > 0, layer.plan_weights(), torch.float32, torch.device("cpu")))


@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("fp8", [False, True])
def test_cpu_plans_take_the_references(mode, fp8, monkeypatch):
    """On the CPU, kernels off or on, every plan names the reference paths (as every chain ended there), and
    the forward's output is the same either way."""
    emulate(monkeypatch, mode)
    m = model(fp8, True)
    for T in T_GRID:
        for name in LAYOUTS:
            if (lens := layout(name, T)) is not None:
                assert {_plan_code(m, kind, lens[0]) for kind in (LINEAR, FULL)} == {"NNeN"}, (T, name)
    for T in (1, 5, 17):
        _, got = run(m, *layout("mixed" if T > 1 else "decode", T))
        with monkeypatch.context() as mp:
            emulate(mp, "off")
            _, want = run(m, *layout("mixed" if T > 1 else "decode", T))
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("mode", GPU_MODES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_gpu_plans_equal_the_chains(mode, fp8, fused, monkeypatch):
    """With the GPU dispatch emulated: the plan of every T of T_GRID, layout and layer kind is the choice the
    chains made (CHAINS), the model takes exactly the planned paths, and its launches are the chains' (the
    same kernels with the same operands, in the same order: DIGESTS)."""
    emulate(monkeypatch, mode)
    m = model(fp8, fused)
    for name in LAYOUTS:
        launches = []
        for kind in (LINEAR, FULL):
            want = CHAINS[mode, fp8, name, kind, fused].split()
            got = [_plan_code(m, kind, lens[0]) if (lens := layout(name, T)) else "-" for T in T_GRID]
            assert got == want, (name, kind)
        for T in T_GRID:
            if (lens := layout(name, T)) is None:
                continue
            events, _ = run(m, *lens)
            launches.append(events)
            for kind in (LINEAR, FULL):
                planned = _plan_code(m, kind, lens[0])
                assert _choices(events, kind, m.cfg.layer_types) == planned, (name, T, kind)
        assert _digest(launches) == DIGESTS[mode, fp8, name, fused], name


def test_layers_of_a_kind_share_their_plan_weights():
    """The plan is asked once per distinct `plan_weights()` in a forward: a quantised model's layers of one
    kind (and the MTP layer, a full-attention one) give one value."""
    for fp8 in (False, True):
        m = model(fp8, True)
        kinds = {}
        for layer in [*m.layers, *m.mtp.layers]:
            kinds.setdefault(layer.layer_type, set()).add(layer.plan_weights())
        assert all(len(v) == 1 for v in kinds.values()), kinds


def test_tuned_tables_are_picked_by_gpu_name(tmp_path, monkeypatch):
    """A GPU's own committed table when there is one, else the deployment GPU's (H200)."""
    from metainfer.kernels import common

    assert common.gpu_slug("NVIDIA H200") == ops.gpu_slug("NVIDIA H200") == "h200"
    assert common.gpu_slug("NVIDIA H100 80GB HBM3") == "h100_80gb"
    here = Path(common.__file__).parent
    assert common.tuned_table_file("moe_pair", "NVIDIA H200") == here / "moe_pair_h200.json"
    assert common.tuned_table_file("moe_pair", None) == here / "moe_pair_h200.json"
    assert common.tuned_table_file("moe_pair", "NVIDIA B200") == here / "moe_pair_h200.json"  # no own
    (tmp_path / "fam_b200.json").write_text('{"configs": {"k": {"X": 2}}}')
    (tmp_path / "fam_h200.json").write_text('{"configs": {"k": {"X": 1}}}')
    monkeypatch.setattr(common, "__file__", str(tmp_path / "common.py"))
    assert common.tuned_table_file("fam", "NVIDIA B200") == tmp_path / "fam_b200.json"
    monkeypatch.setattr(common, "_gpu_name", lambda: "NVIDIA B200")
    assert common.load_tuned("fam", None) == {"k": {"X": 2}}
    monkeypatch.setattr(common, "_gpu_name", lambda: "NVIDIA H200")
    assert common.load_tuned("fam", None) == {"k": {"X": 1}}
