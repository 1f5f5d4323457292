"""The ops the model calls. Each picks a Triton kernel for CUDA tensors when one is registered and
enabled, else the PyTorch reference (always on CPU).

Where several ops can do one job (the MoE experts, a norm fused into its neighbour), `step_plan`
decides once per step and kind of layer which one runs, and the model calls exactly that op.

Kernels are enabled by `use_kernels(True)` (the runner does this on CUDA unless --no-kernels).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from metainfer.kernels import reference as ref

_ENABLED = False
_KERNELS: dict[str, object] = {}


def use_kernels(flag: bool) -> None:
    """Turns the Triton kernels on or off for CUDA tensors (process-wide, set once at start)."""
    global _ENABLED
    _ENABLED = bool(flag)
    if _ENABLED and not _KERNELS:
        try:
            from metainfer.kernels import registry

            _KERNELS.update(registry.load())
        except ImportError:
            _ENABLED = False


def kernels_enabled() -> bool:
    return _ENABLED


def gpu_slug(name: str) -> str:
    """A GPU's part of a tuned table's file name (`kernels.common.gpu_slug`), for writers of tables."""
    from metainfer.kernels import common

    return common.gpu_slug(name)


def has_kernel(name: str) -> bool:
    return _ENABLED and name in _KERNELS


def _kernel(name: str, x: torch.Tensor):
    if _ENABLED and x.is_cuda:
        return _KERNELS.get(name)
    return None


def _serves(name: str, device_type: str) -> bool:
    """Whether `_kernel(name, x)` gives a kernel for tensors on a device of this type."""
    return _ENABLED and device_type == "cuda" and name in _KERNELS


# ---- what the model asks of the kernel paths (it imports no kernel module but this one) -----------
def launch_context(max_chunk: int) -> contextlib.AbstractContextManager:
    """The context a step's launches run (and its CUDA graph is captured) in, for a step whose longest
    chunk has max_chunk tokens: `pdl.off_for` with the kernels on, else nothing."""
    if not _ENABLED:
        return contextlib.nullcontext()
    from metainfer.kernels import pdl

    return pdl.off_for(max_chunk)


class LayerWeights(NamedTuple):
    """What a step plan reads of one decoder layer: its weights' precision and the shapes that the fused
    kernels take. Fixed once the weights are loaded (or quantised)."""

    experts_fp8: bool  # the routed experts e4m3 with block scales
    fused_shared: bool  # the shared expert stored as expert E (the MoE kernels' layout)
    router_dtype: torch.dtype  # the router's weights (with the shared expert's gate row)
    mixer_in_fp8: bool  # the token mixer's first projection e4m3 (attention qkv_proj, DeltaNet in_proj)
    deltanet: bool = False  # a DeltaNet layer; the fields below describe its out_proj
    out_heads: int = 0  # Hv: the gated norm's heads; out_proj's input is out_heads x out_head_dim
    out_head_dim: int = 0
    out_rows: int = 0
    out_dtype: torch.dtype | None = None  # e4m3: block-scaled


@dataclass(frozen=True)
class StepPlan:
    """The ops one step runs through one decoder layer (`step_plan`); each named op serves its operands.

    input_norm: the layer's input norm where it adds a residual: "prologue" (where its input is the
        previous MoE's rows: summed, normed and projected by `pending_norm_linear`), "copy" (the norm also
        writes its e4m3 copy for the first projection, `act_buffers`), "norm"
    moe_norm: the norm before the MoE: "router" (with the router's logits, `add_rms_norm_router`),
        "copy" (x's e4m3 copy for the grouped FP8 experts), "norm"
    moe: "routed_rows" | "pair_rows" | "grouped_rows" (`moe_*`: rows summed by the next norm), or
        "experts" (route, then `moe_experts`)
    out_norm: a DeltaNet layer's gated norm before out_proj: "prologue" (`gated_norm_linear`), "copy",
        "norm"; "norm" in attention layers
    """

    input_norm: Literal["prologue", "copy", "norm"]
    moe_norm: Literal["router", "copy", "norm"]
    moe: Literal["routed_rows", "pair_rows", "grouped_rows", "experts"]
    out_norm: Literal["prologue", "copy", "norm"]


def step_plan(T: int, decodes: bool, w: LayerWeights, dtype: torch.dtype, device: torch.device) -> StepPlan:
    """The plan of a step of T tokens (`decodes`: its first sequences decode) through a layer with weights
    `w`, activations in `dtype` on `device`. Pure Python, no tensor op: safe inside a graph capture."""
    dev = torch.device(device).type
    quant: list[bool] = []  # norm_quant_wanted(T, device), asked at most once

    def copy(norm_op: str) -> bool:  # the norm kernel writes an e4m3 copy for an FP8 consumer of T rows
        if not has_kernel(norm_op):
            return False
        if not quant:
            from metainfer.kernels import fp8_linear

            quant.append(fp8_linear.norm_quant_wanted(T, device))
        return quant[0]

    moe = _moe_path(T, w, dev)
    if T == 1 and moe != "experts" and w.mixer_in_fp8 and _serves("pending_norm_linear", dev):
        input_norm = "prologue"
    elif w.mixer_in_fp8 and not (w.deltanet and decodes) and copy("add_rms_norm"):  # (a DeltaNet step with
        input_norm = "copy"  # decodes runs in_proj with the conv epilogue, which takes no e4m3 copy)
    else:
        input_norm = "norm"
    if w.experts_fp8 and w.fused_shared and _moe_module().grouped_rows_ok(T, True) and copy("add_rms_norm"):
        moe_norm = "copy"
    elif _serves("add_rms_norm_router", dev) and _norm_module().router_ok(T, dtype, w.router_dtype):
        moe_norm = "router"
    else:
        moe_norm = "norm"
    out_norm = "norm"
    if w.deltanet:
        out_fp8 = w.out_dtype == torch.float8_e4m3fn
        if out_fp8 and w.out_head_dim % 128 == 0 and copy("gated_rms_norm"):
            out_norm = "copy"
        elif _serves("gated_norm_linear", dev):
            from metainfer.kernels import weight_stream

            same = w.out_dtype == dtype
            if weight_stream.gnorm_ok(T, w.out_heads, w.out_head_dim, w.out_rows, out_fp8, same):
                out_norm = "prologue"
    return StepPlan(input_norm, moe_norm, moe, out_norm)


def _moe_path(T: int, w: LayerWeights, dev: str) -> str:
    """The plan's `moe`: routing inside the FP8 decode kernels, else the per-pair rows, else (past the
    per-pair bound) the grouped GEMMs' rows; `moe_experts` where no rows kernel serves."""
    if not w.fused_shared:
        return "experts"
    fp8 = w.experts_fp8
    if _serves("moe_routed_rows", dev) and _moe_module().routed_rows_ok(T, fp8):
        return "routed_rows"
    if _serves("moe_pair_rows", dev):
        if 0 < T and _moe_module().use_pair_path(T, fp8):
            return "pair_rows"
        if _moe_module().grouped_rows_ok(T, fp8) and _serves("moe_grouped_rows", dev):
            return "grouped_rows"
    return "experts"


def _moe_module():
    from metainfer.kernels import moe

    return moe


def _norm_module():
    from metainfer.kernels import norm

    return norm


def act_buffers(T: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for a norm kernel to write the e4m3 copy of its [T, K] output into (a plan's "copy"):
    (q [Tp, K] e4m3, s [K/128, Tp] fp32), `fp8_linear.act_buffers`."""
    from metainfer.kernels import fp8_linear

    return fp8_linear.act_buffers(T, K, device)


# ---- the ops -------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    k = _kernel("rms_norm", x)
    return k(x, weight, eps) if k else ref.rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps, xq_out=None):
    """xq_out: buffers for the output's e4m3 copy (`fp8_linear.act_buffers`); the kernel only."""
    k = _kernel("add_rms_norm", x)
    if k:
        return k(x, residual, weight, eps, xq_out=xq_out)
    assert xq_out is None, "xq_out needs the norm kernel"
    return ref.add_rms_norm(x, residual, weight, eps)


def gated_rms_norm(x, z, weight, eps, xq_out=None):
    """xq_out: as `add_rms_norm`'s (the kernel only)."""
    k = _kernel("gated_rms_norm", x)
    if k:
        return k(x, z, weight, eps, xq_out=xq_out)
    assert xq_out is None, "xq_out needs the norm kernel"
    return ref.gated_rms_norm(x, z, weight, eps)


rope_inv_freq = ref.rope_inv_freq


def apply_rope(x, positions, inv_freq):
    return ref.apply_rope(x, positions, inv_freq)


def route(router_logits: torch.Tensor, top_k: int):
    """-> (weights [T, k] fp32 renormalised, ids [T, k] int64)."""
    k = _kernel("route", router_logits)
    return k(router_logits, top_k) if k else ref.route(router_logits, top_k)


def route_with_shared(router_logits: torch.Tensor, top_k: int):
    """logits [T, E+1] -> (weights [T, k+1], ids [T, k+1]); slot k is the shared expert (id E)."""
    k = _kernel("route", router_logits)
    return k(router_logits, top_k, shared=True) if k else ref.route_with_shared(router_logits, top_k)


def moe_experts(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale=None, down_scale=None):
    k = _kernel("moe_experts", x)
    if k:
        return k(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale)
    if gate_up_scale is not None:
        w_gate_up = ref_dequant_fp8(w_gate_up, gate_up_scale, x.dtype)
        w_down = ref_dequant_fp8(w_down, down_scale, x.dtype)
    return ref.moe_experts(x, w_gate_up, w_down, topk_weights, topk_ids)


def moe_routed_rows(x, router_logits, top_k, shared, w_gate_up, w_down, gate_up_scale=None, down_scale=None):
    """Routing + experts with the weighted sum left to `moe_add_rms_norm` (the plan's "routed_rows": the
    routing inside the gate/up kernel, one launch fewer). -> (rows [T, W, H] fp32, weights [T, W] fp32)."""
    k = _kernel("moe_routed_rows", x)
    if k:
        return k(x, router_logits, top_k, shared, w_gate_up, w_down, gate_up_scale, down_scale)
    weights, ids = (route_with_shared if shared else route)(router_logits, top_k)
    return _ref_expert_rows(x, w_gate_up, w_down, ids, gate_up_scale, down_scale), weights


def moe_pair_rows(x, router_logits, top_k, w_gate_up, w_down, gate_up_scale=None, down_scale=None):
    """The route launch, then the per-pair experts with the weighted sum left to `moe_add_rms_norm` (the
    plan's "pair_rows": the combine launch saved): logits [T, E+1] with the shared expert's gate.
    -> (rows [T, W, H] fp32, weights [T, W] fp32)."""
    weights, ids = route_with_shared(router_logits, top_k)
    k = _kernel("moe_pair_rows", x)
    if k:
        return k(x, w_gate_up, w_down, ids, gate_up_scale, down_scale), weights
    return _ref_expert_rows(x, w_gate_up, w_down, ids, gate_up_scale, down_scale), weights


def moe_grouped_rows(x, router_logits, top_k, w_gate_up, w_down, gate_up_scale=None, down_scale=None,
                     xq=None):
    """`moe_pair_rows` for batches past the per-pair path (the plan's "grouped_rows"): the grouped GEMMs'
    rows, in x's dtype. xq: x's e4m3 copy from its norm (`act_buffers`), taken by the FP8 GEMMs."""
    weights, ids = route_with_shared(router_logits, top_k)
    k = _kernel("moe_grouped_rows", x)
    if k:
        return k(x, w_gate_up, w_down, ids, gate_up_scale, down_scale, xq=xq), weights
    return _ref_expert_rows(x, w_gate_up, w_down, ids, gate_up_scale, down_scale).to(x.dtype), weights


def _ref_expert_rows(x, w_gate_up, w_down, ids, gate_up_scale, down_scale) -> torch.Tensor:
    if gate_up_scale is not None:
        w_gate_up = ref_dequant_fp8(w_gate_up, gate_up_scale, x.dtype)
        w_down = ref_dequant_fp8(w_down, down_scale, x.dtype)
    return ref.moe_expert_rows(x, w_gate_up, w_down, ids)


def add_rms_norm_router(x, residual, weight, eps, router_weight):
    """`add_rms_norm(x, residual)` and the MoE router's logits of its output (`linear(normed,
    router_weight)`) in one launch (the plan's "router"): -> (normed, new residual, logits)."""
    k = _kernel("add_rms_norm_router", x)
    if k:
        return k(x, residual, weight, eps, router_weight)
    out, new_res = add_rms_norm(x, residual, weight, eps)
    return out, new_res, linear(out, router_weight)


def moe_add_rms_norm(rows, weights, residual, weight, eps, dtype=None, xq_out=None, res_out=None):
    """`add_rms_norm(moe_combine(rows, weights), residual)`: the MoE's weighted sum, the residual
    add and the next RMSNorm in one pass. -> (normed, new residual). xq_out: as `add_rms_norm`;
    res_out: the new residual's buffer (else a new tensor)."""
    k = _kernel("moe_add_rms_norm", rows)
    if k:
        return k(rows, weights, residual, weight, eps, dtype, xq_out=xq_out, res_out=res_out)
    assert xq_out is None, "xq_out needs the norm kernel"
    x = ref.moe_combine(rows, weights, residual.dtype if residual is not None else dtype)
    out, new_res = add_rms_norm(x, residual, weight, eps)
    if res_out is None:
        return out, new_res
    res_out.copy_(new_res)
    return out, res_out


def pending_norm_linear(rows, weights, residual, norm_weight, eps, new_res, weight, scale_inv, conv=None,
                        dtype=None):
    """rms_norm(moe_combine(rows, weights) + residual) @ weight^T for one decode token (the plan's "prologue";
    weight e4m3 with its scale_inv; new_res gets the new residual; conv: (conv_weight, conv_state, slots,
    has_state), as `linear_conv_update`'s): the norm in the projection's x prologue (cuda/gemv.cu) where that
    kernel takes the operands (`gemv.wanted_pre`: sm_90, its build, the shapes), else the norm, then the
    projection. -> y [1, N]."""
    assert scale_inv is not None, "the prologue projections are e4m3"
    k = _kernel("pending_norm_linear", rows)
    y = k(rows, weights, residual, norm_weight, eps, new_res, weight, scale_inv, conv=conv) if k else None
    if y is not None:  # (None: gemv.cu's operand check declined; GPU-only, it stays the kernel's)
        return y
    h = moe_add_rms_norm(rows, weights, residual, norm_weight, eps, dtype, res_out=new_res)[0]
    if conv is not None:
        return linear_conv_update(h, weight, scale_inv, *conv)
    return fp8_linear(h, weight, scale_inv)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for unquantised weights (the reference is F.linear, cuBLAS on the GPU)."""
    k = _kernel("linear", x)
    if k:
        return k(x, weight)
    return torch.nn.functional.linear(x, weight)


def gated_norm_linear(core, z, norm_weight, eps, weight, scale_inv):
    """`gated_rms_norm(core, z)` viewed [T, Hv * D], then the projection by weight (e4m3 with its
    scale_inv, or unquantised), in one launch (the plan's out_norm "prologue") -> [T, N]."""
    k = _kernel("gated_norm_linear", core)
    if k:
        return k(core, z, norm_weight, eps, weight, scale_inv)
    h = gated_rms_norm(core, z, norm_weight, eps).view(core.shape[0], -1)
    return linear(h, weight) if scale_inv is None else fp8_linear(h, weight, scale_inv)


def linear_conv_update(x, weight, scale_inv, conv_weight, conv_state, slots, has_state):
    """The DeltaNet in_proj y = x W^T with the decode conv applied to the first C = conv channels
    of the first len(slots) rows: y[:B, :C] = causal_conv1d_update(y[:B, :C], ...). -> [T, N]."""
    k = _kernel("linear_conv_update", x)
    if k:
        return k(x, weight, scale_inv, conv_weight, conv_state, slots, has_state)
    y = linear(x, weight) if scale_inv is None else fp8_linear(x, weight, scale_inv)
    B, C = slots.shape[0], conv_weight.shape[0]
    if B:
        y[:B, :C] = causal_conv1d_update(y[:B, :C], conv_state, conv_weight, slots, has_state)
    return y


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, xq=None) -> torch.Tensor:
    """xq: x's e4m3 copy from its norm, an optional shortcut of the kernel path (the same operands)."""
    k = _kernel("fp8_linear", x)
    if k:
        return k(x, weight, scale_inv, xq=xq)
    return torch.nn.functional.linear(x, ref_dequant_fp8(weight, scale_inv, x.dtype))


def ref_dequant_fp8(
    w: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: int = 128
) -> torch.Tensor:
    """[..., N, K] e4m3 with [..., ceil(N/b), ceil(K/b)] scales -> dequantised [..., N, K]."""
    N, K = w.shape[-2:]
    s = scale_inv.repeat_interleave(block, dim=-2)[..., :N, :].repeat_interleave(block, dim=-1)[..., :K]
    return (w.float() * s.float()).to(dtype)


def causal_conv1d_update(x, conv_state, weight, slots, has_state):
    k = _kernel("causal_conv1d_update", x)
    if k:
        return k(x, conv_state, weight, slots, has_state)
    return ref.causal_conv1d_update(x, conv_state, weight, slots, has_state)


def causal_conv1d(x, conv_state, weight, query_start_loc, slots, has_state, cu=None, slots_dev=None,
                  has_dev=None, max_len=None):
    """Varlen prefill conv (host offsets for the reference; device ones and max_len, the grid's
    bound, for the kernel)."""
    kern = _kernel("causal_conv1d", x)
    if kern:
        return kern(x, conv_state, weight, query_start_loc, slots, has_state, cu, slots_dev, has_dev, max_len)
    return ref.causal_conv1d(x, conv_state, weight, query_start_loc, slots, has_state)


def gdn_decode(q, k, v, g, beta, ssm_state, slots, has_state):
    """One gated-delta-rule step per sequence on its state slot (updated in place).

    q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; ssm_state [S, Hv, Dk, Dv] fp32 or bf16 storage
    (fp32 math, the new state rounded to the storage). -> [B, Hv, Dv].
    """
    kern = _kernel("gdn_decode", q)
    if kern:
        return kern(q, k, v, g, beta, ssm_state, slots, has_state)
    init = ssm_state[slots].float() * has_state[:, None, None, None].float()
    out, final = ref.gated_delta_rule_recurrent(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], init
    )
    ssm_state[slots] = final.to(ssm_state.dtype)
    return out[:, 0]


def gdn_decode_gated(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_state):
    """`gdn_decode` from the raw gate projections a, b [B, Hv]. -> [B, Hv, Dv]."""
    kern = _kernel("gdn_decode_gated", q)
    if kern:
        return kern(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_state)
    return gdn_decode(q, k, v, *ref.gdn_gating(a, b, A_log, dt_bias), ssm_state, slots, has_state)


def gdn_prefill_varlen(
    q, k, v, g, beta, cu_seqlens, ssm_state, slots, has_state, max_seqlen, out, gating=None
):
    """Chunked gated delta rule over N sequences at rows cu[n]:cu[n+1] of q, k, v [T, H, D];
    initial states read from and final states written to ssm_state at `slots` (zeros where
    not has_state). Writes out[cu[0]:cu[N]] ([T, Hv, Dv]) and returns `out`. gating = (A_log,
    dt_bias): g, beta are the raw projections a, b, gated as `reference.gdn_gating` (in the kernel)."""
    kern = _kernel("gdn_prefill_varlen", q)
    if gating is not None and not kern:
        g, beta = ref.gdn_gating(g, beta, *gating)  # torch ops (the reference)
        gating = None
    if kern:
        return kern(q, k, v, g, beta, cu_seqlens, ssm_state, slots, has_state, max_seqlen, out=out,
                    gating=gating)
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        s, e = cu[i], cu[i + 1]
        init = ssm_state[slot].float() if bool(has_state[i]) else ssm_state.new_zeros(ssm_state.shape[1:],
                                                                                       dtype=torch.float32)
        if e > s:  # an empty sequence keeps its start state, as the kernel does
            o, init = ref.gated_delta_rule_chunked(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init)
            out[s:e] = o
        ssm_state[slot] = init.to(ssm_state.dtype)
    return out


def paged_attention(q, k_cache, v_cache, meta, scale, gate=None):
    """Causal attention of this step's tokens over the paged cache, times sigmoid(gate) when given.
    q, gate [T, Hq, D] -> [T, Hq, D]."""
    kern = _kernel("paged_attention", q)
    if kern:
        return kern(q, k_cache, v_cache, meta, scale, gate)
    o = ref.paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc_cpu, meta.seq_lens_cpu, scale
    )
    return o if gate is None else o * torch.sigmoid(gate)


def qk_norm_rope_write(q, k, v, q_weight, k_weight, eps, positions, inv_freq, k_cache, v_cache, slot_mapping):
    """q/k RMSNorm (1 + w), partial NeoX RoPE, k/v into the paged cache. -> q [T, Hq, D]."""
    kern = _kernel("qk_norm_rope_write", q)
    if kern:
        return kern(q, k, v, q_weight, k_weight, eps, positions, inv_freq, k_cache, v_cache, slot_mapping)
    q = ref.apply_rope(rms_norm(q, q_weight, eps), positions, inv_freq)
    k = ref.apply_rope(rms_norm(k, k_weight, eps), positions, inv_freq)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Stores this step's keys/values [T, Hkv, D] at flat cache slots [T]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def decode_inputs(packed, tok_buf, n: int, context_lens, seq_lens) -> None:
    """The decode graph's packed rows into the model's inputs (kernels.decode_io.decode_inputs)."""
    k = _kernel("decode_inputs", packed)
    (k or ref.decode_inputs)(packed, tok_buf, n, context_lens, seq_lens)


def argmax_rows(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[:R] = argmax of each row of x [R, V] (lowest index on ties); -> out."""
    k = _kernel("argmax_rows", x)
    return k(x, out) if k else ref.argmax_rows(x, out)
