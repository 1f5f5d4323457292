"""One gated-delta-rule decode step per sequence on its fp32 state slot (updated in place).

Memory-bound: each program owns a [Dk, BLOCK_V] column block of one value head's state, holds the
whole Dk column in registers, and reads and writes each state element exactly once. Grid:
(B, Hv, Dv / BLOCK_V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metainfer.kernels import pdl

_TL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16)  # the recurrent states' storage (the math is fp32)

# value columns per program and warps; tuned on H200 by benchmarks/kernels_a.py
BLOCK_V = 32
NUM_WARPS = 4


@triton.jit
def _load_state(state_ptr, slots_ptr, has_ptr, b, h, kk, vv, vmask, HV: tl.constexpr, DK: tl.constexpr,
                DV: tl.constexpr):
    """-> (the [BLOCK_K, BLOCK_V] state block of sequence b, value head h, in fp32 whatever the
    storage; zeros where the slot holds no state yet, its pointers)."""
    slot = tl.load(slots_ptr + b).to(tl.int64)
    n_k = DK * tl.load(has_ptr + b).to(tl.int32)  # DK when the slot holds state, else 0
    s_ptrs = state_ptr + (slot * HV + h) * (DK * DV) + kk[:, None] * DV + vv[None, :]
    S = tl.load(s_ptrs, mask=(kk < n_k)[:, None] & vmask[None, :], other=0.0, eviction_policy="evict_first")
    return S.to(tl.float32), s_ptrs


@triton.jit
def _lanes(DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's key rows (all of them) and value columns (block program_id(2)), with masks."""
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    return kk, kk < DK, vv, vv < DV


@triton.jit
def _gates(a, b, alog_ptr, dtb_ptr, beta_ptr, h, GATED: tl.constexpr):
    """(decay, beta) from the loaded g / beta values a, b (fp32; a scalar or one per token). GATED:
    a, b are the raw projections; g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) rounded
    to b's dtype (as DeltaNet.gating does); else decay = exp(g), beta = b."""
    if GATED:
        a = a + tl.load(dtb_ptr + h).to(tl.float32)
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        decay = tl.exp(-tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus)
        beta = tl.sigmoid(b).to(beta_ptr.dtype.element_ty).to(tl.float32)  # rounded like b.sigmoid()
    else:
        decay = tl.exp(a)
        beta = b
    return decay, beta


@triton.jit
def _delta_update(S, q, k, v, decay, beta):
    """The gated delta rule on the state block S [BLOCK_K, BLOCK_V] for one token (q, k normalised,
    [BLOCK_K]; v [BLOCK_V]; decay, beta scalars): -> (S', its output columns [BLOCK_V] fp32)."""
    S = S * decay
    kv = tl.sum(S * k[:, None], axis=0)  # [BLOCK_V]
    delta = (v - kv) * beta
    S = S + k[:, None] * delta[None, :]
    return S, tl.sum(S * q[:, None], axis=0)


@triton.jit
def _delta_token(S, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, row, h, hk, kk, kmask, vv, vmask,
                 sq0, sq1, sk0, sk1, sv0, sv1, sg0, sb0, scale, GATED: tl.constexpr):
    """One token (`row` of q, k, v, g, beta) through the gated delta rule on the state block S
    [BLOCK_K, BLOCK_V]: -> (S', its output columns [BLOCK_V] fp32); the gates as `_gates`."""
    q = tl.load(q_ptr + row * sq0 + hk * sq1 + kk, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * sk0 + hk * sk1 + kk, mask=kmask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + row * sv0 + h * sv1 + vv, mask=vmask, other=0.0).to(tl.float32)
    a = tl.load(g_ptr + row * sg0 + h).to(tl.float32)
    b = tl.load(beta_ptr + row * sb0 + h).to(tl.float32)
    decay, beta = _gates(a, b, alog_ptr, dtb_ptr, beta_ptr, h, GATED)
    return _delta_update(S, q, k, v, decay, beta)


@triton.jit
def _gdn_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, has_ptr, out_ptr, alog_ptr, dtb_ptr,
    sq0, sq1, sk0, sk1, sv0, sv1, sg0, sb0, scale,
    HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr = 0,
):
    """q, k: [B, Hk, DK]; v: [B, HV, DV]; g, beta: [B, HV]; state [S, HV, DK, DV] fp32; out [B, HV, DV].
    GATED: see `_delta_token`. The state block is read before the PDL wait: the kernel before this
    one (the projection) writes neither the states nor the slot inputs, which the step's first
    copies wrote."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kk, kmask, vv, vmask = _lanes(DK, DV, BLOCK_K, BLOCK_V)
    S, s_ptrs = _load_state(state_ptr, slots_ptr, has_ptr, b, h, kk, vv, vmask, HV, DK, DV)
    pdl.wait(USE_PDL)
    S, o = _delta_token(S, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, b, h, h // REP, kk, kmask,
                        vv, vmask, sq0, sq1, sk0, sk1, sv0, sv1, sg0, sb0, scale, GATED)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=kmask[:, None] & vmask[None, :],
             eviction_policy="evict_first")
    tl.store(out_ptr + (b * HV + h) * DV + vv, o.to(out_ptr.dtype.element_ty), mask=vmask)


def _launch(q, k, v, g, beta, ssm_state, slots, has_state, block_v: int, num_warps: int,
            A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    B, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    assert k.shape == q.shape and v.shape[0] == B, (q.shape, k.shape, v.shape)
    assert Hv % Hk == 0, (Hv, Hk)
    for t in (q, k, v):
        assert t.stride(2) == 1, "q, k, v: last dim must be contiguous"
        assert t.dtype in _TL_DTYPES, t.dtype
    gated = A_log is not None
    assert g.shape == (B, Hv) and (gated or g.dtype == torch.float32) and g.stride(1) == 1, (g.shape, g.dtype)
    assert not gated or (A_log.shape == (Hv,) and dt_bias.shape == (Hv,)), "A_log, dt_bias: [Hv]"
    assert beta.shape == (B, Hv) and beta.stride(1) == 1 and beta.dtype in _TL_DTYPES, beta.shape
    assert ssm_state.dtype in STATE_DTYPES and ssm_state.is_contiguous(), ssm_state.dtype
    assert ssm_state.dim() == 4 and ssm_state.shape[1:] == (Hv, Dk, Dv), (ssm_state.shape, Hv, Dk, Dv)
    assert slots.shape == (B,) and slots.dtype == torch.int64, (slots.shape, slots.dtype)
    assert has_state.shape == (B,) and has_state.dtype == torch.bool, (has_state.shape, has_state.dtype)
    out = torch.empty(B, Hv, Dv, dtype=v.dtype, device=v.device)
    if B == 0:
        return out
    block_v = min(block_v, triton.next_power_of_2(Dv))
    _gdn_decode_kernel[(B, Hv, triton.cdiv(Dv, block_v))](
        q, k, v, g, beta, ssm_state, slots, has_state.view(torch.uint8), out,
        A_log if gated else g, dt_bias if gated else g,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), Dk**-0.5,
        HV=Hv, REP=Hv // Hk, DK=Dk, DV=Dv, BLOCK_K=triton.next_power_of_2(Dk), BLOCK_V=block_v, GATED=gated,
        num_warps=num_warps, **pdl.kw(),
    )
    return out


def gdn_decode(
    q: torch.Tensor,  # [B, Hk, Dk]
    k: torch.Tensor,  # [B, Hk, Dk]
    v: torch.Tensor,  # [B, Hv, Dv]
    g: torch.Tensor,  # [B, Hv] fp32 log decay
    beta: torch.Tensor,  # [B, Hv]
    ssm_state: torch.Tensor,  # [S, Hv, Dk, Dv] fp32, updated in place at `slots`
    slots: torch.Tensor,  # [B] int64
    has_state: torch.Tensor,  # [B] bool; False: the step starts from a zero state
) -> torch.Tensor:
    """S = S * exp(g); S += k (x) beta (v - S^T k); out = S^T q, with l2-normalised q, k. -> [B, Hv, Dv]."""
    return _launch(q, k, v, g, beta, ssm_state, slots, has_state, BLOCK_V, NUM_WARPS)


def gdn_decode_gated(
    q: torch.Tensor,  # [B, Hk, Dk]
    k: torch.Tensor,  # [B, Hk, Dk]
    v: torch.Tensor,  # [B, Hv, Dv]
    a: torch.Tensor,  # [B, Hv] raw in_proj_a output
    b: torch.Tensor,  # [B, Hv] raw in_proj_b output
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    ssm_state: torch.Tensor,  # [S, Hv, Dk, Dv] fp32, updated in place at `slots`
    slots: torch.Tensor,  # [B] int64
    has_state: torch.Tensor,  # [B] bool
) -> torch.Tensor:
    """`gdn_decode` with the gating folded in: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    return _launch(q, k, v, a, b, ssm_state, slots, has_state, BLOCK_V, NUM_WARPS, A_log, dt_bias)


# ---- short chunks: the decode update looped over each sequence's tokens -------------------------
RECURRENT_MAX_T = 16  # chunks up to this long (a speculative verify's 1 + K tokens): the recurrent kernel


@triton.jit
def _gdn_recurrent_varlen_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, has_ptr, out_ptr, alog_ptr, dtb_ptr, cu_ptr,
    sq0, sq1, sk0, sk1, sv0, sv1, sg0, sb0, so0, so1, scale,
    HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr = 0,
):
    """Sequence n's tokens cu[n]:cu[n+1] through `_gdn_decode_kernel`'s update one after another,
    the [DK, BLOCK_V] state block held in registers between them: read and written once per chunk
    (the chunked prefill's two kernels cost far more on a few tokens). Same operands as the decode
    kernel with a token axis; out [T, HV, DV] at rows cu[0]:cu[N]."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kk, kmask, vv, vmask = _lanes(DK, DV, BLOCK_K, BLOCK_V)
    pdl.wait(USE_PDL)
    start = tl.load(cu_ptr + n).to(tl.int64)  # int64 row offsets: the loop variable is one
    end = tl.load(cu_ptr + n + 1).to(tl.int64)
    S, s_ptrs = _load_state(state_ptr, slots_ptr, has_ptr, n, h, kk, vv, vmask, HV, DK, DV)
    for t in range(start, end):
        S, o = _delta_token(S, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, t, h, h // REP,
                            kk, kmask, vv, vmask, sq0, sq1, sk0, sk1, sv0, sv1, sg0, sb0, scale, GATED)
        tl.store(out_ptr + t * so0 + h * so1 + vv, o.to(out_ptr.dtype.element_ty), mask=vmask)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=kmask[:, None] & vmask[None, :],
             eviction_policy="evict_first")


def gdn_recurrent_varlen(
    q, k, v, g, beta, cu_seqlens, ssm_state, slots, has_state, out, gating=None
) -> torch.Tensor:
    """`gdn_prefill.gdn_prefill_varlen`'s contract (checked there) by the token-by-token recurrence:
    for short chunks (speculative verifies). One launch, graph-capturable, no host sync."""
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    N = slots.shape[0]
    if N == 0:
        return out
    gated = gating is not None
    A_log, dt_bias = gating if gated else (g, g)
    block_v = min(BLOCK_V, triton.next_power_of_2(Dv))
    _gdn_recurrent_varlen_kernel[(N, Hv, triton.cdiv(Dv, block_v))](
        q, k, v, g, beta, ssm_state, slots, has_state.view(torch.uint8), out, A_log, dt_bias, cu_seqlens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), out.stride(0), out.stride(1), Dk**-0.5,
        HV=Hv, REP=Hv // Hk, DK=Dk, DV=Dv, BLOCK_K=triton.next_power_of_2(Dk), BLOCK_V=block_v, GATED=gated,
        num_warps=NUM_WARPS, **pdl.kw(),
    )
    return out
