"""Weight-streaming linears for a few tokens (decode): y = x W^T with W [N, K] e4m3 + fp32 block
scales [ceil(N/128), ceil(K/128)] (W8A16), or W unquantised in x's dtype (`dense_linear`).

`_skinny_kernel` streams every weight tile once and dequantises it in registers. The weight scale
of each 128x128 block multiplies the activation chunk, so the inner loop is a plain e4m3 convert
plus an FMA/MMA. BLOCK_T == 1 reduces on the CUDA cores (e4m3 -> fp32 per element); BLOCK_T >= 16
(any T, a single token padded) runs a swapped-operand MMA (W tile as the M side, tokens as the N
side) over 128-wide K sub-steps (BLOCK_K / 128 per pipelined iteration) on exact operands and
multiplies each fp32 product by its block scale; DOT_F16 makes the operands fp16 (one packed
e4m3x2 -> f16x2 convert; bf16 activations are exact in fp16 below 65504, which the normalised
inputs of every dense projection are). Split-K keeps 4 (T == 1) or 2 CTAs per SM busy even for
N = 2048; the last CTA of each N tile to finish adds the fp32 partials in split order
(deterministic, one launch, counters reset by that CTA). `_gemv_kernel` loads each program's whole
tile in one go, before the PDL wait. The epilogue shared by both (`_store_tile`): the DeltaNet decode
conv (`fp8_linear.linear_conv_update`). Configs come from the H200 table (`stream_config`).
`_gnorm_gemv_kernel` is the DeltaNet out_proj of one decode token with the gated RMSNorm as its
prologue, its weights loaded before the PDL wait (`gated_norm_linear`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metainfer.kernels import pdl
from metainfer.kernels.common import TL_DTYPE, gated_norm, load_tuned, num_sms, upcast_dots, wdot
from metainfer.settings import settings

SKINNY_MAX_T = 64  # the most tokens the streaming kernels serve (more: fp8_linear's GEMM)
# the most tokens an FP8 dense projection streams its weights for (W8A16); past it the activations are
# quantised and the W8A8 GEMM (cuBLAS blockwise on the H200) runs, measured faster there
FP8_STREAM_MAX_T = 16

_LOCKS: dict[tuple[torch.device, int], torch.Tensor] = {}


# ---- kernels -------------------------------------------------------------------------------------
@triton.jit
def _conv_epilogue(acc, offs_n, offs_t, n_conv, n_dec, cstate_ptr, cw_ptr, slots_ptr, has_ptr, s_slot, s_k,
                   OUT_DT: tl.constexpr, CONV_K: tl.constexpr, Y_DT: tl.constexpr):
    """acc [BLOCK_N, BLOCK_T] fp32 of output columns offs_n, tokens offs_t -> the values to store:
    for columns n < n_conv of the decode rows t < n_dec, silu(causal conv1d of [state, y]) with
    each row's conv state (slot slots[t]; zeros where not has[t]) shifted in place, as
    `conv1d._conv_update_kernel` computes it; elsewhere y = acc in OUT_DT. Each (column, slot) is
    touched by one program only (the output tile's owner)."""
    y = acc.to(OUT_DT)
    c_mask = offs_n < n_conv
    d_mask = offs_t < n_dec
    on = c_mask[:, None] & d_mask[None, :]
    slot = tl.load(slots_ptr + offs_t, mask=d_mask, other=0).to(tl.int64)
    has = tl.load(has_ptr + offs_t, mask=d_mask, other=0).to(tl.int32) > 0
    s_base = cstate_ptr + slot[None, :] * s_slot + offs_n[:, None]  # [BLOCK_N, BLOCK_T]
    w_base = cw_ptr + offs_n * CONV_K
    c = y.to(tl.float32) * tl.load(w_base + (CONV_K - 1), mask=c_mask, other=0.0).to(tl.float32)[:, None]
    for j in tl.static_range(CONV_K - 1):  # window = [state[0], ..., state[K-2], y]; new state = window[1:]
        prev = tl.load(s_base + j * s_k, mask=on & has[None, :], other=0.0).to(OUT_DT)
        c += prev.to(tl.float32) * tl.load(w_base + j, mask=c_mask, other=0.0).to(tl.float32)[:, None]
        if j > 0:
            tl.store(s_base + (j - 1) * s_k, prev.to(cstate_ptr.dtype.element_ty), mask=on)
    tl.store(s_base + (CONV_K - 2) * s_k, y.to(cstate_ptr.dtype.element_ty), mask=on)
    c = c.to(Y_DT).to(tl.float32)
    return tl.where(on, (c * tl.sigmoid(c)).to(OUT_DT), y)


@triton.jit
def _finish_tile(acc, offs_n, offs_t, y_ptr, T, N, stride_yt, cstate_ptr, cw_ptr, slots_ptr, has_ptr, n_conv,
                 n_dec, s_slot, s_k, CONV_K: tl.constexpr, Y_DT: tl.constexpr):
    """A complete output tile acc [BLOCK_N, BLOCK_T] fp32 -> y: the conv epilogue (CONV_K) or a
    cast, then the store."""
    if CONV_K:
        out = _conv_epilogue(acc, offs_n, offs_t, n_conv, n_dec, cstate_ptr, cw_ptr, slots_ptr, has_ptr,
                             s_slot, s_k, y_ptr.dtype.element_ty, CONV_K, Y_DT)
    else:
        out = acc.to(y_ptr.dtype.element_ty)
    y_mask = (offs_n < N)[:, None] & (offs_t < T)[None, :]
    tl.store(y_ptr + offs_t[None, :] * stride_yt + offs_n[:, None], out, mask=y_mask)


@triton.jit
def _store_tile(acc, pid_n, pid_k, n_tiles, offs_n, offs_t, y_ptr, part_ptr, lock_ptr, T, N, stride_yt,
                cstate_ptr, cw_ptr, slots_ptr, has_ptr, n_conv, n_dec, s_slot, s_k, SPLIT_K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, CONV_K: tl.constexpr, Y_DT: tl.constexpr):
    """acc [BLOCK_N, BLOCK_T] fp32: the share (K split pid_k) of output tile pid_n (of n_tiles),
    columns offs_n, tokens offs_t -> y. SPLIT_K > 1: fp32 partials, and the last
    program of the tile to arrive (int counter, acq_rel) adds them in split order (deterministic)
    and resets the counter. Then the epilogue: CONV_K `_conv_epilogue`."""
    if SPLIT_K == 1:
        _finish_tile(acc, offs_n, offs_t, y_ptr, T, N, stride_yt, cstate_ptr, cw_ptr, slots_ptr, has_ptr,
                     n_conv, n_dec, s_slot, s_k, CONV_K, Y_DT)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + offs_t[None, :]
        tl.store(part_ptr + (pid_k * n_tiles + pid_n) * (BLOCK_N * BLOCK_T) + tile, acc)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
            for sk in tl.static_range(SPLIT_K):
                src = part_ptr + (sk * n_tiles + pid_n) * (BLOCK_N * BLOCK_T) + tile
                total += tl.load(src, cache_modifier=".cg")
            _finish_tile(total, offs_n, offs_t, y_ptr, T, N, stride_yt, cstate_ptr, cw_ptr, slots_ptr,
                         has_ptr, n_conv, n_dec, s_slot, s_k, CONV_K, Y_DT)
            tl.atomic_xchg(lock_ptr + pid_n, 0)


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    lock_ptr,
    T,
    N,
    K,
    stride_xt,
    stride_yt,
    stride_sn,
    iters_per_split,
    cstate_ptr,
    cw_ptr,
    slots_ptr,
    has_ptr,
    n_conv,
    n_dec,
    s_slot,
    s_k,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_F16: tl.constexpr = 0,
    HAS_SCALE: tl.constexpr = 1,  # 0: unquantised (BF16) weights, s_ptr unused
    CONV_K: tl.constexpr = 0,  # > 0: the DeltaNet decode conv (this kernel size) as the epilogue
    Y_DT: tl.constexpr = tl.float32,  # CONV_K: the conv weight's dtype (the conv output's rounding)
    USE_PDL: tl.constexpr = 0,
):
    """CONV_K: `_conv_epilogue` on the output tile (by the split-K fix-up program when split)."""
    pdl.wait(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    n_mask = offs_n < N
    t_mask = offs_t < T
    s_row = s_ptr + (pid_n * BLOCK_N // 128) * stride_sn  # BLOCK_N divides 128
    k_lo = pid_k * iters_per_split
    k_hi = tl.minimum(k_lo + iters_per_split, tl.cdiv(K, BLOCK_K))
    if BLOCK_T == 1:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
    for ki in tl.range(k_lo, k_hi, num_stages=STAGES):  # per-loop stages: pipelines non-dot loads too
        if BLOCK_T == 1:  # CUDA cores: e4m3 -> fp32 per element, FMA with the scaled activation
            offs_k = ki * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0)  # [BN, BK]
            xv = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            if HAS_SCALE:
                xv = xv * tl.load(s_row + offs_k // 128, mask=k_mask, other=0.0)  # [BLOCK_K]
            acc2 += w.to(tl.float32) * xv[None, :]
        else:  # tensor cores: 128-wide sub-steps on exact e4m3 and x operands, each block's scale after
            for sub in tl.static_range(BLOCK_K // 128):
                offs_k = ki * BLOCK_K + sub * 128 + tl.arange(0, 128)
                k_mask = offs_k < K
                w_mask = n_mask[:, None] & k_mask[None, :]
                w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=w_mask, other=0.0)  # [BN,128]
                x_mask = t_mask[None, :] & k_mask[:, None]
                xt = tl.load(x_ptr + offs_t[None, :] * stride_xt + offs_k[:, None], mask=x_mask, other=0.0)
                if HAS_SCALE:
                    kb = ki * (BLOCK_K // 128) + sub  # past K (a ragged last step): w, x are zeros
                    acc += wdot(w, xt, UPCAST, DOT_F16) * tl.load(s_row + kb, mask=kb * 128 < K, other=0.0)
                else:
                    acc += wdot(w, xt, UPCAST, DOT_F16)
    if BLOCK_T == 1:
        acc = tl.sum(acc2, axis=1)[:, None]  # [BLOCK_N, 1]
    _store_tile(acc, pid_n, pid_k, tl.num_programs(0), offs_n, offs_t, y_ptr, part_ptr, lock_ptr, T, N,
                stride_yt, cstate_ptr, cw_ptr, slots_ptr, has_ptr, n_conv, n_dec, s_slot, s_k, SPLIT_K,
                BLOCK_N, BLOCK_T, CONV_K, Y_DT)


@triton.jit
def _load_tile(weight_ptr, wscale_ptr, offs_n, offs_k, w_mask, k_mask, s_row, K, HAS_SCALE: tl.constexpr):
    """-> (the [BLOCK_N, KS] weight tile, the block scale of each of its columns; ones without scales)."""
    w = tl.load(weight_ptr + offs_n[:, None] * K + offs_k[None, :], mask=w_mask, other=0.0)
    if HAS_SCALE:
        sc = tl.load(wscale_ptr + s_row + offs_k // 128, mask=k_mask, other=0.0)
    else:
        sc = tl.full(offs_k.shape, 1.0, tl.float32)
    return w, sc


@triton.jit
def _gemv_kernel(
    x_ptr, weight_ptr, wscale_ptr, y_ptr, part_ptr, lock_ptr, T, N, K, stride_xt, stride_yt, stride_sn,
    cstate_ptr, cw_ptr, slots_ptr, has_ptr, n_conv, n_dec, s_slot, s_k,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    KS: tl.constexpr,  # columns per program: the whole [BLOCK_N, KS] weight tile is one load
    HAS_SCALE: tl.constexpr = 1,
    CONV_K: tl.constexpr = 0,
    Y_DT: tl.constexpr = tl.float32,
    USE_PDL: tl.constexpr = 0,
):
    """The weight-streaming linear for a few tokens, one load per program: each program reads its
    whole [BLOCK_N, KS] weight tile (and its block scales) into registers in one go, before the PDL
    wait (weights are never written during a step), then the activations, and reduces on the CUDA
    cores one token at a time (BLOCK_T tokens at most). Output as `_skinny_kernel` (`_store_tile`:
    split-K fix-up, conv epilogue)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * KS + tl.arange(0, KS)
    n_mask = offs_n < N
    k_mask = offs_k < K
    w_mask = n_mask[:, None] & k_mask[None, :]
    s_row = (tl.program_id(0) * BLOCK_N // 128) * stride_sn  # BLOCK_N divides 128: one row of scale blocks
    w, sc = _load_tile(weight_ptr, wscale_ptr, offs_n, offs_k, w_mask, k_mask, s_row, K, HAS_SCALE)
    pdl.wait(USE_PDL)
    offs_t = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
    for t in tl.static_range(BLOCK_T):
        x_mask = offs_k < tl.where(t < T, K, 0)
        xv = tl.load(x_ptr + t * stride_xt + offs_k, mask=x_mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            xv = xv * sc
        col = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)  # [BLOCK_N]
        acc = tl.where(offs_t[None, :] == t, col[:, None], acc)
    _store_tile(acc, tl.program_id(0), tl.program_id(1), tl.num_programs(0), offs_n, offs_t, y_ptr, part_ptr,
                lock_ptr, T, N, stride_yt, cstate_ptr, cw_ptr, slots_ptr, has_ptr, n_conv, n_dec, s_slot, s_k,
                SPLIT_K, BLOCK_N, BLOCK_T, CONV_K, Y_DT)


@triton.jit
def _gnorm_gemv_kernel(
    core_ptr, z_ptr, gw_ptr, weight_ptr, wscale_ptr, y_ptr, part_ptr, lock_ptr,
    T, N, K, stride_ct, stride_ch, stride_zt, stride_zh, stride_yt, stride_sn, eps,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEADS: tl.constexpr,  # heads (D columns each) per program: K split SPLIT_K ways
    D: tl.constexpr,
    MID: tl.constexpr,  # the norm weight's product dtype (`reference.gated_rms_norm`'s promotion)
    HAS_SCALE: tl.constexpr = 1,  # FP8 weights with [N/128, K/128] block scales (D == 128: a head per block)
    USE_PDL: tl.constexpr = 0,
):
    """The DeltaNet output: y = gated_rms_norm(core, z) @ W^T for a few tokens, the norm as the
    projection's prologue. Each program loads its whole weight tile (BLOCK_N rows x HEADS heads of D)
    before the PDL wait (weights are never written during a step: the bytes stream while the DeltaNet
    kernel runs), then normalises and gates its heads of each token (`common.gated_norm`) and reduces
    one token at a time on the CUDA cores (a [BLOCK_N, HEADS, D] tile), each head's product times its
    block scale. A grid of one wave keeps PDL's overlap. Output as `_skinny_kernel` (`_store_tile`:
    the split-K fix-up)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = pid_k * HEADS + tl.arange(0, HEADS)
    offs_d = tl.arange(0, D)
    cols = offs_h[:, None] * D + offs_d[None, :]  # [HEADS, D]: W's columns of head h, dim d
    w = tl.load(weight_ptr + offs_n.to(tl.int64)[:, None, None] * K + cols[None, :, :],
                mask=(offs_n < N)[:, None, None], other=0.0)  # [BLOCK_N, HEADS, D]
    if HAS_SCALE:
        sc = tl.load(wscale_ptr + (pid_n * BLOCK_N // 128) * stride_sn + offs_h)  # [HEADS]
    pdl.wait(USE_PDL)
    gw = tl.load(gw_ptr + offs_d).to(tl.float32)
    offs_t = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
    for t in tl.static_range(BLOCK_T):
        hm = (offs_h < tl.where(t < T, K // D, 0))[:, None]  # the heads of a real token
        c = tl.load(core_ptr + t * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :], mask=hm,
                    other=0.0)
        z = tl.load(z_ptr + t * stride_zt + offs_h[:, None] * stride_zh + offs_d[None, :], mask=hm,
                    other=0.0)
        x = gated_norm(c, z, gw, eps, D, 1, MID).to(tl.float32)  # [HEADS, D]
        head = tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)  # [BLOCK_N, HEADS]
        if HAS_SCALE:
            head = head * sc[None, :]
        acc = tl.where(offs_t[None, :] == t, tl.sum(head, axis=1)[:, None], acc)
    _store_tile(acc, pid_n, pid_k, tl.num_programs(0), offs_n, offs_t, y_ptr, part_ptr, lock_ptr, T, N,
                stride_yt, y_ptr, y_ptr, y_ptr, y_ptr, 0, 0, 0, 0, SPLIT_K, BLOCK_N, BLOCK_T, 0, tl.float32)


# ---- launchers -----------------------------------------------------------------------------------
def _lock_key(device: torch.device) -> tuple[torch.device, int]:
    return device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _locks(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 split-K counters, one set per stream (kernels on one stream run in order, and
    each leaves its counters at zero). Allocated on a stream's first call, normally the eager
    warm-up before CUDA-graph capture; one first made during capture lives in the graph's pool."""
    key = _lock_key(device)
    buf = _LOCKS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _LOCKS[key] = buf
    return buf


def tuned_table() -> dict[str, dict]:
    """Weight-streaming configs: FP8 keyed "N,K,T", unquantised (`dense_linear`) "bf16:N,K,T"
    (benchmarks/sweep_decode_kernels.py)."""
    return load_tuned("fp8_skinny", settings().fp8_tuned)


def stream_config(T: int, N: int, K: int, fp8: bool, device: torch.device) -> dict | None:
    """The weight-streaming config for T tokens of an [N, K] projection: the H200 table's
    preloading-GEMV entry ("gemv:" + key, `_gemv_kernel`), else its
    `_skinny_kernel` entry (FP8 "N,K,T", BF16 "bf16:N,K,T"); without one FP8 takes
    `skinny_config`'s heuristic and BF16 gets None (cuBLAS serves it)."""
    key = f"{N},{K},{T}" if fp8 else f"bf16:{N},{K},{T}"
    table = tuned_table()
    if f"gemv:{key}" in table:
        return dict(table[f"gemv:{key}"])
    if fp8:
        return skinny_config(T, N, K, num_sms(device))
    hit = table.get(key)
    return None if hit is None else dict(hit)


def gemv_config(K: int, T: int, block_n: int, ks: int, num_warps: int = 4) -> dict:
    """A `_gemv_kernel` config: BLOCK_N output rows (a power of two dividing 128) x KS columns
    (a power of two, at most next_power_of_2(K)) per program; split-K where KS < K."""
    ks = min(ks, triton.next_power_of_2(K))
    return dict(BLOCK_N=block_n, BLOCK_T=triton.next_power_of_2(T), KS=ks, SPLIT_K=triton.cdiv(K, ks),
                num_warps=num_warps)


_BY_SHAPE: dict[int, tuple[dict, dict[tuple[int, int], list[tuple[int, dict]]]]] = {}


def _by_shape(table: dict[str, dict]) -> dict[tuple[int, int], list[tuple[int, dict]]]:
    """The table's FP8 "N,K,T" entries as (N, K) -> [(T, config)] by T, built once per table object
    (a lookup that misses runs on every eager projection call)."""
    hit = _BY_SHAPE.get(id(table))
    if hit is None or hit[0] is not table:
        index: dict[tuple[int, int], list[tuple[int, dict]]] = {}
        for key, cfg in table.items():
            parts = key.split(",")
            if len(parts) == 3 and all(p.isdigit() for p in parts):
                n, k, t = (int(p) for p in parts)
                index.setdefault((n, k), []).append((t, cfg))
        for rows in index.values():
            rows.sort(key=lambda r: r[0])
        hit = _BY_SHAPE[id(table)] = (table, index)
    return hit[1]


def tuned_row(table: dict[str, dict], N: int, K: int, T: int) -> dict | None:
    """The table's FP8 "N,K,T" config for T tokens, else the one measured at the fewest tokens
    T' in (T, 2T) whose tile holds T (BLOCK_T >= T): a decode batch of 24 takes the 32-token
    config, 40-64 the 64-token one."""
    hit = table.get(f"{N},{K},{T}")
    if hit is not None:
        return hit
    for t, cfg in _by_shape(table).get((N, K), ()):
        if T < t < 2 * T and cfg.get("BLOCK_T", 0) >= T:
            return cfg
    return None


def skinny_config(T: int, N: int, K: int, num_sms: int) -> dict:
    """(BLOCK_N, BLOCK_T, BLOCK_K, SPLIT_K, warps, stages) for the weight-streaming kernel."""
    hit = tuned_row(tuned_table(), N, K, T)
    if hit is not None:
        return dict(hit)
    block_t = 1 if T == 1 else max(16, triton.next_power_of_2(T))
    block_n = 32 if T == 1 else 64
    block_k = 256 if T == 1 else 128
    tiles = triton.cdiv(N, block_n)
    k_iters = triton.cdiv(K, block_k)
    split = max(1, min(k_iters, ((4 if T == 1 else 2) * num_sms) // tiles))
    per = triton.cdiv(k_iters, split)
    return dict(
        BLOCK_N=block_n,
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        SPLIT_K=triton.cdiv(k_iters, per),
        iters_per_split=per,
        STAGES=4,
        num_warps=4,
    )


def stream_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, y: torch.Tensor,
            cfg: dict | None = None, conv: tuple | None = None) -> None:
    """y = x @ dequant(w)^T by weight streaming; s None: unquantised weights in x's dtype.
    conv = (conv_weight [C, k], conv_state [S, k-1, C], slots [B], has_state [B]): the first C
    columns of the first B rows become the DeltaNet decode conv + SiLU of themselves."""
    T, K = x.shape
    N = w.shape[0]
    assert cfg is not None or s is not None, "unquantised weights: the caller picks the config"
    cfg = dict(cfg or stream_config(T, N, K, True, x.device))
    cw, cstate, slots, has = conv if conv is not None else (x, x, x, x)  # unused pointers without it
    cargs = (cstate, cw, slots, has, 0, 0, 0, 0)
    if conv is not None:
        C, ck = cw.shape
        assert cw.is_contiguous() and cstate.shape[1:] == (ck - 1, C) and cstate.stride(2) == 1, cstate.shape
        assert slots.dtype == torch.int64 and has.dtype == torch.bool and slots.shape == has.shape
        assert C <= N and slots.shape[0] <= T
        cargs = (cstate, cw, slots, has.view(torch.uint8), C, slots.shape[0], *cstate.stride()[:2])
        cfg.update(CONV_K=ck, Y_DT=TL_DTYPE[cw.dtype])
    if s is None:
        assert w.dtype == x.dtype and not cfg.get("DOT_F16"), (w.dtype, x.dtype)
        s, cfg["HAS_SCALE"] = w, 0
    assert 128 % cfg["BLOCK_N"] == 0 and cfg["BLOCK_T"] >= T
    tiles = triton.cdiv(N, cfg["BLOCK_N"])
    args = (x, w, s, y)
    tail = (T, N, K, x.stride(0), y.stride(0), s.stride(0))
    gemv = "KS" in cfg
    if gemv:
        assert cfg["SPLIT_K"] == triton.cdiv(K, cfg["KS"]), (cfg, K)
    else:
        assert cfg["BLOCK_T"] == 1 or cfg["BLOCK_K"] % 128 == 0, "the tensor-core loop steps by scale blocks"
    split = cfg["SPLIT_K"]
    part = torch.empty(
        split * tiles * cfg["BLOCK_N"] * cfg["BLOCK_T"] if split > 1 else 1,
        dtype=torch.float32,
        device=x.device,
    )
    locks = _locks(x.device, tiles)
    if gemv:
        _gemv_kernel[(tiles, split)](*args, part, locks, *tail, *cargs, **cfg, **pdl.kw())
    else:
        _skinny_kernel[(tiles, split)](*args, part, locks, *tail, cfg.pop("iters_per_split"), *cargs,
                                       UPCAST=upcast_dots(x), **cfg, **pdl.kw())


ALIGN_ROWS = 8  # output rows of 16 bytes (bf16): cuBLAS's sm_90 kernels need aligned leading dimensions


def aligned_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for N = weight.shape[0] not a multiple of ALIGN_ROWS (the MoE router's
    E + 1 = 257 rows): cuBLAS takes an unaligned output's leading dimension only on its sm_75
    align1 kernels (several times slower). The weight padded with zero
    rows (kept on the weight tensor with its version counter, made on first use: the engine's eager
    warmup, before graph capture) gives an aligned [.., N_pad] output -> its first N columns, a view
    with row stride N_pad."""
    N = weight.shape[0]
    try:
        now = weight._version
    except RuntimeError:  # an inference tensor: no version counter
        now = -1
    version, padded = getattr(weight, "_aligned_rows", (None, None))
    if version != now:  # none yet, or the weight written in place since (a reload)
        padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, -N % ALIGN_ROWS))
        weight._aligned_rows = (now, padded)
    return torch.nn.functional.linear(x, padded)[..., :N]


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T, weight in x's dtype (BF16 projections, the MoE router): the
    weight-streaming kernel where a measured config for (N, K, T) exists (the H200 table, keys
    "bf16:N,K,T": chosen where it beat cuBLAS), else F.linear."""
    N, K = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    hit = stream_config(x2.shape[0], N, K, False, x.device) if x.is_cuda else None
    if hit is None or weight.dtype != x.dtype or not weight.is_contiguous() or x2.stride(-1) != 1:
        if x.is_cuda and N % ALIGN_ROWS:
            return aligned_linear(x, weight)
        return torch.nn.functional.linear(x, weight)
    y = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    stream_linear(x2, weight, None, y, hit)
    return y.reshape(*lead, N)


GNORM_MAX_T = 1  # the most tokens `gated_norm_linear` takes (decode batches past 1 measured slower)


def gnorm_config(N: int, Hv: int, fp8: bool) -> dict:
    """(BLOCK_N, HEADS, num_warps) of `_gnorm_gemv_kernel`: one wave of preloading programs, 64 KB of
    weights each (FP8 [16, 32 x 128]: 128 programs for out_proj [2048, 4096]; BF16 [8, 32 x 128])."""
    return dict(BLOCK_N=16 if fp8 else 8, HEADS=Hv, num_warps=8)


def gnorm_ok(T: int, Hv: int, D: int, N: int, fp8: bool, same_dtype: bool) -> bool:
    """Whether `gated_norm_linear` takes T tokens of Hv heads x D into N rows: up to GNORM_MAX_T tokens, D a
    power of two (FP8: one 128-column scale block, else weights in core's dtype: same_dtype), and a
    `gnorm_config` whose heads a program (a power of two) divide Hv."""
    if not 0 < T <= GNORM_MAX_T or D & (D - 1) or (fp8 and D != 128) or (not fp8 and not same_dtype):
        return False
    cfg = gnorm_config(N, Hv, fp8)
    return not (Hv % cfg["HEADS"] or cfg["HEADS"] & (cfg["HEADS"] - 1) or 128 % cfg["BLOCK_N"])


def gated_norm_linear(
    core: torch.Tensor,  # [T, Hv, D], D contiguous
    z: torch.Tensor,  # [T, Hv, D], D contiguous (a view of in_proj's output)
    norm_weight: torch.Tensor,  # [D]
    eps: float,
    weight: torch.Tensor,  # [N, Hv * D] contiguous: e4m3 with scale_inv [N/128, Hv * D/128], or core's dtype
    scale_inv: torch.Tensor | None,
) -> torch.Tensor:
    """`gated_rms_norm(core, z) @ weight^T` (the DeltaNet out_proj) in one launch of weight-preloading
    programs (`_gnorm_gemv_kernel`) -> y [T, N] in core's dtype, for shapes `gnorm_ok` takes."""
    T, Hv, D = core.shape
    N, K = weight.shape
    fp8 = scale_inv is not None
    assert gnorm_ok(T, Hv, D, N, fp8, weight.dtype == core.dtype), (core.shape, weight.shape, weight.dtype)
    assert K == Hv * D and z.shape == core.shape and core.stride(2) == 1 and z.stride(2) == 1, (K, z.shape)
    assert weight.is_contiguous()
    cfg = gnorm_config(N, Hv, fp8)
    s = scale_inv if fp8 else weight
    mid = TL_DTYPE[torch.promote_types(norm_weight.dtype, core.dtype)]
    y = torch.empty(T, N, dtype=core.dtype, device=core.device)
    tiles, split = triton.cdiv(N, cfg["BLOCK_N"]), Hv // cfg["HEADS"]
    bt = triton.next_power_of_2(T)
    part = torch.empty(split * tiles * cfg["BLOCK_N"] * bt if split > 1 else 1, dtype=torch.float32,
                       device=core.device)
    _gnorm_gemv_kernel[(tiles, split)](
        core, z, norm_weight, weight, s, y, part, _locks(core.device, tiles), T, N, K, core.stride(0),
        core.stride(1), z.stride(0), z.stride(1), y.stride(0), s.stride(0), eps, SPLIT_K=split, BLOCK_T=bt,
        D=D, MID=mid, HAS_SCALE=int(fp8), **cfg, **pdl.kw(),
    )
    return y
