"""Attention input prologue in one launch: q/k RMSNorm (x / rms * (1 + w)), partial NeoX RoPE on
the first `rotary_dim` dims, and the store of this step's keys and values into the paged cache.

Reference: `reference.rms_norm` -> `reference.apply_rope` -> `ops.write_kv`. The kernel keeps the
normed values in fp32 through the rotation (the reference rounds to the model dtype in between)
and takes cos/sin in fp32 (the reference rounds them too): differences are a few bf16 ulps.
Grid: (T, Hq + Hkv); program (t, h) handles query head h (h < Hq) or key head h - Hq, and the
matching value head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metainfer.kernels import pdl


@triton.jit
def norm_rope(src, d, mask, w_ptr, pos, inv_freq_ptr, eps, D: tl.constexpr, RD: tl.constexpr,
              AXIS: tl.constexpr):
    """The math of this launch on the rows at src + d (d: the dims, along AXIS, the last axis):
    RMSNorm x / rms * (1 + w), then NeoX RoPE on the first RD dims at position pos. -> fp32."""
    half: tl.constexpr = RD // 2
    partner = tl.where(d < half, d + half, tl.where(d < RD, d - half, d))
    x = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=AXIS, keep_dims=True) / D + eps)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=d < D, other=0.0).to(tl.float32)
    xn = x * rstd * (1.0 + w)
    xpn = xp * rstd * (1.0 + wp)
    freq = pos * tl.load(inv_freq_ptr + tl.where(d < half, d, d - half), mask=d < RD, other=0.0)
    rot = tl.where(d < half, -xpn, xpn)
    return tl.where(d < RD, xn * tl.cos(freq) + rot * tl.sin(freq), xn)


def check_inputs(q, k, v, positions, inv_freq, slot_mapping) -> None:
    """q [T, Hq, D], k, v [T, Hkv, D] (D contiguous), positions / slot_mapping [T] (slots int64),
    inv_freq fp32 contiguous: the shapes both launchers take."""
    T, _, D = q.shape
    for x in (q, k, v):
        assert x.stride(2) == 1 and x.shape[0] == T and x.shape[2] == D, (x.shape, x.stride())
    assert k.shape == v.shape, (k.shape, v.shape)
    assert positions.shape == (T,) and slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64
    assert inv_freq.dtype == torch.float32 and inv_freq.is_contiguous()


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    wq_ptr,
    wk_ptr,
    pos_ptr,
    inv_freq_ptr,
    slot_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    eps,
    HQ: tl.constexpr,
    D: tl.constexpr,
    RD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl.wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    is_q = h < HQ
    if is_q:
        src = q_ptr + t * sq_t + h * sq_h
        w_ptr = wq_ptr
    else:
        src = k_ptr + t * sk_t + (h - HQ) * sk_h
        w_ptr = wk_ptr
    y = norm_rope(src, d, dmask, w_ptr, tl.load(pos_ptr + t).to(tl.float32), inv_freq_ptr, eps, D, RD, 0)
    if is_q:
        tl.store(q_out_ptr + (t * HQ + h) * D + d, y.to(q_out_ptr.dtype.element_ty), mask=dmask)
    else:
        hk = h - HQ
        slot = tl.load(slot_ptr + t)
        HKV = tl.num_programs(1) - HQ
        dst = (slot * HKV + hk) * D + d
        tl.store(k_cache_ptr + dst, y.to(k_cache_ptr.dtype.element_ty), mask=dmask)
        v = tl.load(v_ptr + t * sv_t + hk * sv_h + d, mask=dmask, other=0.0)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=dmask)


def qk_norm_rope_write(
    q: torch.Tensor,  # [T, Hq, D] (may be a strided view of q_proj's output)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    eps: float,
    positions: torch.Tensor,  # [T] int64
    inv_freq: torch.Tensor,  # [rotary_dim / 2] fp32
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> torch.Tensor:
    """-> q normed and rotated [T, Hq, D] (contiguous); k (normed, rotated) and v land in the cache."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    check_inputs(q, k, v, positions, inv_freq, slot_mapping)
    assert k_cache.shape[2:] == (Hkv, D) and k_cache.is_contiguous()
    assert v_cache.shape == k_cache.shape and v_cache.is_contiguous()
    q_out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T:
        _qk_norm_rope_kernel[(T, Hq + Hkv)](
            q,
            k,
            v,
            q_weight,
            k_weight,
            positions,
            inv_freq,
            slot_mapping,
            q_out,
            k_cache,
            v_cache,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            eps,
            HQ=Hq,
            D=D,
            RD=2 * inv_freq.numel(),
            BLOCK_D=triton.next_power_of_2(D), **pdl.kw(),
        )
    return q_out
