"""Routed experts: out[t] = sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j].

Weights are BF16 or FP8 e4m3 with 128x128 block scales, dequantised in registers (W8A16), so
FP8 follows `ops.moe_experts`' dequantise-then-BF16 semantics. Accumulation is fp32; the
SiLU*up activation is rounded to x's dtype as in the reference (the large-T path also stores each
expert's output in x's dtype; the small-T path keeps it in fp32 until the weighted sum).
No host synchronisation and no allocation sized by device values (CUDA-graph capturable), and
no float atomics: the same inputs give the same output bits.

Small T (decode; `use_pair_path`): `_pair_gate_up_kernel` over (pair, I-block) writes
silu(gate) * up for each of the T*k (token, slot) pairs; then either `_pair_down_rows_kernel` over
(pair, H-block) writes each pair's fp32 output and `_combine_kernel` adds them with the routing
weights in slot order ("rows", the default), or `_pair_down_kernel` over (token, H-block) does both
("fused"). Each pair reads its expert's rows once; the loops pipeline all their loads
(`tl.range(num_stages=...)`). `moe_routed_rows` (FP8, up to ROUTED_MAX_T tokens) routes inside the
gate/up kernel and leaves the weighted sum to the next add+RMSNorm (`norm.moe_add_rms_norm`): two
launches per layer instead of four.

Large T: the pairs are bucketed by expert on the device (`_count_kernel`, then `_bucket_kernel`:
positions from int atomics), each bucket padded to BLOCK_M rows inside a buffer of worst-case size
P + min(E, P) * (BLOCK_M - 1). `_grouped_gate_up_kernel` (gate and up tiles of one expert, fused
SiLU*mul) and `_grouped_down_kernel` run over (M-block, N-block) and read each expert's weights
once per M-block; the down kernel writes one row per pair and `_combine_kernel` sums each token's
k rows with its routing weights in slot order. The order of pairs inside a bucket varies between
runs, but each row is computed independently of its position, so the result does not.
METAINFER_MOE_W8A8=1 (FP8 weights, off until measured on the H200): both GEMMs take e4m3
activations quantised per token and 128 columns (`fp8_linear.act_quant`, the dense prefill GEMM's
scheme) and run e4m3 x e4m3 on the tensor cores, each 128-wide step's product times both scales.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from metainfer.kernels import pdl, routing
from metainfer.kernels.fp8_linear import act_quant, load_tuned, mma, wdot

PAIR_MAX_T = 8
DOWN_PRELOAD_ENV = "METAINFER_MOE_DOWN_PRELOAD"  # "1": `_routed_down_kernel` (off until measured)
DOWN_PRELOAD_BLOCK_H = 32
A8_ENV = "METAINFER_MOE_W8A8"  # "1": FP8 prefill experts on e4m3 x e4m3 tensor cores (off until measured)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- small T: one program per (pair, block) ------------------------------------------------------
@triton.jit
def _pair_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, logits_ptr, tw_ptr, H, I, E, stride_we, stride_se, stride_sn,
    stride_lt,
    SLOTS: tl.constexpr, FP8: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, MMA: tl.constexpr = 0, UPCAST: tl.constexpr = 0, DOT_F16: tl.constexpr = 0,
    ROUTE_K: tl.constexpr = 0, E_P2: tl.constexpr = 1, K_P2: tl.constexpr = 1,
    USE_PDL: tl.constexpr = 0,
):
    """Pair = (token, slot), SLOTS slots per token. MMA: the weight tiles go through the tensor
    cores against a 16-column operand holding the activation in column 0 (exact operands, no
    per-element convert + FMA on the CUDA cores; FP8: the row scales multiply each 128-wide step's
    product). Otherwise fp32 FMA on the CUDA cores.

    ROUTE_K > 0: the routing is done here, not read from ids: slot j < ROUTE_K finds its expert by
    j + 1 rounds of `routing.softmax_topk` over the token's E router logits (the same steps as
    `_route_kernel`, so the same picks); a slot ROUTE_K (SLOTS = ROUTE_K + 1) is the shared expert,
    id E, weight sigmoid(logit E). The first I-block of the last routed slot writes the token's
    ids and renormalised weights, the shared slot's its own, for the down and combine steps."""
    pdl.wait(USE_PDL)
    pair = tl.program_id(0)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = offs_i < I
    t = pair // SLOTS
    if ROUTE_K:
        j = pair - t * SLOTS
        e, vals, idx = routing.slot_pick(logits_ptr + t * stride_lt, E, j, ROUTE_K, E_P2, K_P2)
        slot = tl.arange(0, K_P2)
        first = (tl.program_id(1) == 0).to(tl.int32)
        wmask = slot < ROUTE_K * first * (j == ROUTE_K - 1).to(tl.int32)  # (written as a bound: the
        tl.store(ids_ptr + t * SLOTS + slot, idx.to(tl.int64), mask=wmask)  # interpreter cannot & a
        tl.store(tw_ptr + t * SLOTS + slot, vals / tl.sum(vals, axis=0), mask=wmask)  # scalar mask)
        if SLOTS > ROUTE_K:
            first_shared = first * (j == ROUTE_K).to(tl.int32) > 0
            g = tl.load(logits_ptr + t * stride_lt + E).to(tl.float32)
            tl.store(ids_ptr + pair, e, mask=first_shared)
            tl.store(tw_ptr + pair, tl.sigmoid(g), mask=first_shared)
    else:
        e = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + t * H
    wg_rows = w_ptr + e * stride_we + offs_i[:, None] * H  # [BLOCK_I, 1] gate rows; up rows at +I*H
    s_base = s_ptr + e * stride_se
    ACC_N: tl.constexpr = 16 if MMA else BLOCK_K
    col = tl.arange(0, 16)
    acc_g = tl.zeros((BLOCK_I, ACC_N), tl.float32)
    acc_u = tl.zeros((BLOCK_I, ACC_N), tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        m2 = i_mask[:, None] & k_mask[None, :]
        xv = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
        wg = tl.load(wg_rows + offs_k[None, :], mask=m2, other=0.0)
        wu = tl.load(wg_rows + I * H + offs_k[None, :], mask=m2, other=0.0)
        if MMA:
            xb = tl.where(col[None, :] == 0, xv[:, None], 0.0).to(xv.dtype)  # [BLOCK_K, 16]
            pg = wdot(wg, xb, UPCAST, DOT_F16)
            pu = wdot(wu, xb, UPCAST, DOT_F16)
        else:
            pg = wg.to(tl.float32)
            pu = wu.to(tl.float32)
        if FP8:  # BLOCK_K divides 128: one scale column per step
            sg = tl.load(s_base + (offs_i // 128) * stride_sn + k0 // 128, mask=i_mask, other=0.0)
            su = tl.load(s_base + ((offs_i + I) // 128) * stride_sn + k0 // 128, mask=i_mask, other=0.0)
            pg = pg * sg[:, None]
            pu = pu * su[:, None]
        if MMA:
            acc_g += pg
            acc_u += pu
        else:
            acc_g += pg * xv.to(tl.float32)[None, :]
            acc_u += pu * xv.to(tl.float32)[None, :]
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    tl.store(act_ptr + pair * I + offs_i, (g * tl.sigmoid(g) * u).to(act_ptr.dtype.element_ty), mask=i_mask)


@triton.jit
def _pair_down_kernel(
    act_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, out_ptr, H, I, stride_we, stride_se, stride_sn,
    TOP_K: tl.constexpr, FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """One flat loop over (slot, K-block) so the weight stream pipelines across the k experts; the
    routing weight (and the FP8 block scale: BLOCK_H divides 128) multiply the activation chunk."""
    pdl.wait(USE_PDL)
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    h_blk = tl.program_id(1) * BLOCK_H // 128
    n_k = tl.cdiv(I, BLOCK_K)
    acc = tl.zeros((BLOCK_H, BLOCK_K), tl.float32)
    for it in tl.range(0, TOP_K * n_k, num_stages=STAGES):
        j = it // n_k
        k0 = (it - j * n_k) * BLOCK_K
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < I
        a = tl.load(act_ptr + pair * I + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        a = a * tl.load(tw_ptr + pair)
        if FP8:
            a = a * tl.load(s_ptr + e * stride_se + h_blk * stride_sn + k0 // 128)
        w_mask = h_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + e * stride_we + offs_h[:, None] * I + offs_k[None, :], mask=w_mask, other=0.0)
        acc += w.to(tl.float32) * a[None, :]
    tl.store(out_ptr + t * H + offs_h, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=h_mask)


@triton.jit
def _pair_down_rows_kernel(
    act_ptr, w_ptr, s_ptr, ids_ptr, y_ptr, H, I, stride_we, stride_se, stride_sn,
    FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    MMA: tl.constexpr = 0, UPCAST: tl.constexpr = 0, DOT_F16: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
):
    """y[pair, h-block] = down_e(act[pair]) in fp32, one program per (pair, H-block): T*k times
    more programs than `_pair_down_kernel`, so a single token still spreads over every SM. The
    weighted sum over a token's slots is `_combine_kernel`'s (fixed slot order). MMA as in
    `_pair_gate_up_kernel` (BLOCK_H and BLOCK_K divide 128: one FP8 scale per step)."""
    pdl.wait(USE_PDL)
    pair = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    h_blk = tl.program_id(1) * BLOCK_H // 128
    e = tl.load(ids_ptr + pair).to(tl.int64)
    ACC_N: tl.constexpr = 16 if MMA else BLOCK_K
    col = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_H, ACC_N), tl.float32)
    for k0 in tl.range(0, I, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < I
        a = tl.load(act_ptr + pair * I + offs_k, mask=k_mask, other=0.0)
        w_mask = h_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + e * stride_we + offs_h[:, None] * I + offs_k[None, :], mask=w_mask, other=0.0)
        if MMA:
            p = wdot(w, tl.where(col[None, :] == 0, a[:, None], 0.0).to(a.dtype), UPCAST, DOT_F16)
            if FP8:
                p = p * tl.load(s_ptr + e * stride_se + h_blk * stride_sn + k0 // 128)
            acc += p
        else:
            af = a.to(tl.float32)
            if FP8:
                af = af * tl.load(s_ptr + e * stride_se + h_blk * stride_sn + k0 // 128)
            acc += w.to(tl.float32) * af[None, :]
    tl.store(y_ptr + pair * H + offs_h, tl.sum(acc, axis=1), mask=h_mask)


@triton.jit
def _routed_down_kernel(
    act_ptr, w_ptr, s_ptr, logits_ptr, y_ptr, H, I, E, stride_we, stride_se, stride_sn, stride_lt,
    SLOTS: tl.constexpr, ROUTE_K: tl.constexpr, FP8: tl.constexpr, BLOCK_H: tl.constexpr,
    I_P2: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """`_pair_down_rows_kernel` for the routed rows path (after `_pair_gate_up_kernel` with
    ROUTE_K), its weights loaded BEFORE the PDL wait: the program finds its (token, slot)'s expert
    from the router logits itself (`routing.slot_pick`, the gate/up kernel's picks: the logits were
    written two kernels back, so they are final once this kernel launches) and loads its whole
    [BLOCK_H, I] weight tile (and block scales) while the gate/up kernel still runs; then waits,
    reads the pair's activation and reduces on the CUDA cores. y[pair, h-block] fp32."""
    pair = tl.program_id(0)
    t = pair // SLOTS
    e, _, _ = routing.slot_pick(logits_ptr + t * stride_lt, E, pair - t * SLOTS, ROUTE_K, E_P2, K_P2)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k = tl.arange(0, I_P2)
    h_mask = offs_h < H
    k_mask = offs_k < I
    w_mask = h_mask[:, None] & k_mask[None, :]
    w = tl.load(w_ptr + e * stride_we + offs_h[:, None] * I + offs_k[None, :], mask=w_mask, other=0.0)
    if FP8:  # BLOCK_H divides 128: one row of scale blocks
        s_row = e * stride_se + (tl.program_id(1) * BLOCK_H // 128) * stride_sn
        sc = tl.load(s_ptr + s_row + offs_k // 128, mask=k_mask, other=0.0)
    pdl.wait(USE_PDL)
    a = tl.load(act_ptr + pair * I + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if FP8:
        a = a * sc
    tl.store(y_ptr + pair * H + offs_h, tl.sum(w.to(tl.float32) * a[None, :], axis=1), mask=h_mask)


# ---- large T: bucket by expert, grouped GEMMs ----------------------------------------------------
@triton.jit
def _count_kernel(ids_ptr, counts_ptr, P, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    pdl.wait(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    tl.atomic_add(counts_ptr + ids, 1, mask=mask)


@triton.jit
def _bucket_kernel(
    ids_ptr, counts_ptr, cursor_ptr, ends_ptr, sorted_ptr, P, E,
    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """sorted[ends[e] - padded[e] + rank] = pair, padded[e] = counts[e] rounded up to BLOCK_M."""
    pdl.wait(USE_PDL)
    offs_e = tl.arange(0, E_P2)
    cnt = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # [E_P2] inclusive
    if tl.program_id(0) == 0:
        tl.store(ends_ptr + offs_e, ends, mask=offs_e < E)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    rank = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
    pos = tl.gather(ends - padded, ids, 0) + rank
    tl.store(sorted_ptr + pos, offs, mask=mask)


@triton.jit
def _block_expert(ends_ptr, counts_ptr, row0, E, BLOCK_M: tl.constexpr, E_P2: tl.constexpr):
    """-> (expert of the M-block starting at padded row row0, its valid-row mask [BLOCK_M])."""
    offs_e = tl.arange(0, E_P2)
    ends = tl.load(ends_ptr + offs_e, mask=offs_e < E, other=2147483647)
    e = tl.minimum(tl.sum((ends <= row0).to(tl.int32)), E - 1)
    cnt = tl.load(counts_ptr + e)
    start = tl.load(ends_ptr + e) - (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    return e.to(tl.int64), (row0 - start + tl.arange(0, BLOCK_M)) < cnt


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, sorted_ptr, ends_ptr, counts_ptr, act_ptr, H, I, E, stride_we, stride_se, stride_sn,
    xs_ptr, n_xs,
    TOP_K: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr, E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A8: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
):
    """A8 (FP8 weights, BLOCK_K 128): x holds e4m3 activations with per-(token, 128-column) scales
    xs [H/128, n_xs]; the MMA runs on both e4m3 operands and each step's product takes both scales."""
    pdl.wait(USE_PDL)
    row0 = tl.program_id(0) * BLOCK_M
    if row0 >= tl.load(ends_ptr + E - 1):
        return
    e, valid = _block_expert(ends_ptr, counts_ptr, row0, E, BLOCK_M, E_P2)
    rows = row0 + tl.arange(0, BLOCK_M)
    tok = tl.load(sorted_ptr + rows, mask=valid, other=0) // TOP_K  # [BLOCK_M]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    wg_rows = w_ptr + e * stride_we + offs_n[:, None] * H  # [BLOCK_N, 1]; up rows at +I*H
    s_base = s_ptr + e * stride_se
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        a_mask = valid[:, None] & k_mask[None, :]
        a = tl.load(x_ptr + tok[:, None] * H + offs_k[None, :], mask=a_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
        wmask = n_mask[:, None] & k_mask[None, :]
        bg = tl.trans(tl.load(wg_rows + offs_k[None, :], mask=wmask, other=0.0))  # [BLOCK_K, BLOCK_N]
        bu = tl.trans(tl.load(wg_rows + I * H + offs_k[None, :], mask=wmask, other=0.0))
        if FP8:  # exact e4m3 operands; the block scale multiplies the step's product
            sg = tl.load(s_base + (offs_n // 128) * stride_sn + k0 // 128, mask=n_mask, other=0.0)
            su = tl.load(s_base + ((offs_n + I) // 128) * stride_sn + k0 // 128, mask=n_mask, other=0.0)
            if A8:
                sa = tl.load(xs_ptr + (k0 // 128) * n_xs + tok, mask=valid, other=0.0)[:, None]
                acc_g += mma(a, bg, UPCAST) * (sa * sg[None, :])
                acc_u += mma(a, bu, UPCAST) * (sa * su[None, :])
            else:
                acc_g += mma(a, bg, UPCAST) * sg[None, :]
                acc_u += mma(a, bu, UPCAST) * su[None, :]
        else:
            acc_g += mma(a, bg, UPCAST)
            acc_u += mma(a, bu, UPCAST)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    out_mask = valid[:, None] & n_mask[None, :]
    tl.store(act_ptr + rows[:, None] * I + offs_n[None, :], act.to(act_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _grouped_down_kernel(
    act_ptr, w_ptr, s_ptr, sorted_ptr, ends_ptr, counts_ptr, y_ptr, H, I, E, stride_we, stride_se, stride_sn,
    as_ptr, n_as,
    FP8: tl.constexpr, UPCAST: tl.constexpr, E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A8: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
):
    """A8: act holds e4m3 with per-(row, 128-column) scales as [I/128, n_as] (see the gate/up kernel)."""
    pdl.wait(USE_PDL)
    row0 = tl.program_id(0) * BLOCK_M
    if row0 >= tl.load(ends_ptr + E - 1):
        return
    e, valid = _block_expert(ends_ptr, counts_ptr, row0, E, BLOCK_M, E_P2)
    rows = row0 + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows, mask=valid, other=0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    w_rows = w_ptr + e * stride_we + offs_n[:, None] * I  # [BLOCK_N, 1]
    s_rows = s_ptr + e * stride_se + (offs_n // 128) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < I
        a_mask = valid[:, None] & k_mask[None, :]
        a = tl.load(act_ptr + rows[:, None] * I + offs_k[None, :], mask=a_mask, other=0.0)
        b = tl.trans(tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0))
        if FP8:
            sb = tl.load(s_rows + k0 // 128, mask=n_mask, other=0.0)[None, :]
            if A8:
                sb = sb * tl.load(as_ptr + (k0 // 128) * n_as + rows, mask=valid, other=0.0)[:, None]
            acc += mma(a, b, UPCAST) * sb
        else:
            acc += mma(a, b, UPCAST)
    out_mask = valid[:, None] & n_mask[None, :]
    tl.store(y_ptr + pair[:, None] * H + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_kernel(y_ptr, tw_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                    USE_PDL: tl.constexpr = 0):
    pdl.wait(USE_PDL)
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in range(TOP_K):
        y = tl.load(y_ptr + (t * TOP_K + j) * H + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        acc += tl.load(tw_ptr + t * TOP_K + j) * y
    tl.store(out_ptr + t * H + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_lt, TOP_K: tl.constexpr, E_P2: tl.constexpr,
                  K_P2: tl.constexpr, SHARED: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """One token: fp32 softmax over E logits, top-k by repeated argmax (lowest index on ties),
    weights renormalised to sum 1. SHARED: logit E gates the shared expert, stored as slot TOP_K
    (id E, weight sigmoid(logit E))."""
    pdl.wait(USE_PDL)
    t = tl.program_id(0)
    W: tl.constexpr = TOP_K + SHARED
    routing.route_token(logits_ptr + t * stride_lt, E, w_ptr + t * W, ids_ptr + t * W, TOP_K, SHARED,
                        E_P2, K_P2)


# ---- launchers -----------------------------------------------------------------------------------
def route_topk(
    router_logits: torch.Tensor, top_k: int, shared: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.route` in one launch: logits [T, E] (rows may be strided) -> (weights [T, k] fp32,
    ids [T, k] int64). shared: logits are [T, E+1] and a slot k (id E, weight sigmoid(logit E))
    is appended for the shared expert, as in `reference.route_with_shared`."""
    T, E = router_logits.shape
    E -= int(shared)
    assert router_logits.stride(1) == 1 and 0 < top_k <= E, (router_logits.stride(), top_k)
    w = torch.empty(T, top_k + int(shared), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k + int(shared), dtype=torch.int64, device=router_logits.device)
    if T:
        _route_kernel[(T,)](router_logits, w, ids, E, router_logits.stride(0), TOP_K=top_k,
                            E_P2=triton.next_power_of_2(E), K_P2=triton.next_power_of_2(top_k),
                            SHARED=int(shared), **pdl.kw())
    return w, ids


def pair_config(T: int, fp8: bool = False) -> dict:
    """Tiles of the per-pair path. Chosen by the H200 sweep (benchmarks/kernels_b.py --sweep,
    2026-11-30): T=1 BF16 21.4 µs, FP8 16.2 µs with 8-row gate/up blocks; T=32 FP8 180 µs with 16.
    DOWN: "rows" = per-pair down programs + combine (parallel over pairs), "fused" = one program per
    (token, H-block) looping over the slots."""
    hit = load_tuned("moe_pair_h200.json", "METAINFER_MOE_TUNED").get(f"{'fp8' if fp8 else 'bf16'},{T}")
    if hit is not None:  # measured (benchmarks/sweep_decode_kernels.py); MMA = the tensor-core variant
        return dict(hit)
    return dict(BLOCK_I=8 if T <= 4 else 16, BLOCK_H=32, BLOCK_K=128, STAGES=4, num_warps=2, DOWN="rows")


def use_pair_path(T: int, fp8: bool) -> bool:
    """Per-pair path up to 8 tokens (BF16) or 32 (FP8: beat the grouped GEMM 180 vs 193 µs at T=32)."""
    return T <= (32 if fp8 else PAIR_MAX_T)


def grouped_config(T: int, top_k: int, E: int, fp8: bool = False) -> dict:
    """Tile sizes by the mean rows per expert (decode batches: 16-row M-blocks, little padding).
    At 16-row blocks the sweep picked 128-wide N tiles for BF16 (259 µs at T=32) and 32/64 for FP8."""
    rows = T * top_k / E
    bm = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 96 else 128
    key = f"grouped:{'fp8' if fp8 else 'bf16'}:{bm}"
    hit = load_tuned("moe_pair_h200.json", "METAINFER_MOE_TUNED").get(key)
    if hit is not None:  # measured per M-block size (benchmarks/sweep_decode_kernels.py --grouped-tokens)
        return dict(hit)
    if bm == 16:
        gn, dn = (32, 64) if fp8 else (128, 128)
        return dict(BLOCK_M=16, GU_BLOCK_N=gn, DN_BLOCK_N=dn, BLOCK_K=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=bm, GU_BLOCK_N=64, DN_BLOCK_N=128 if bm >= 64 else 64, BLOCK_K=64,
                num_warps=4 if bm <= 32 else 8, num_stages=3)


def _scale_args(scale: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    if scale is None:
        return w, 0, 0  # unused pointer
    E, N, K = w.shape
    assert scale.dtype == torch.float32 and scale.is_contiguous(), (scale.dtype, scale.stride())
    assert tuple(scale.shape) == (E, triton.cdiv(N, 128), triton.cdiv(K, 128)), scale.shape
    return scale, scale.stride(0), scale.stride(1)


def _pair_gate_up(x, w_gate_up, gu, ids, fp8: bool, cfg: dict, route=None) -> torch.Tensor:
    """silu(gate) * up of every (token, slot) pair -> act [T*W, I]. route = (logits, top_k, tw):
    the kernel routes (see `_pair_gate_up_kernel`) and writes ids and tw."""
    T, H = x.shape
    slots = ids.shape[1]
    I = w_gate_up.shape[1] // 2
    act = torch.empty(T * slots, I, dtype=x.dtype, device=x.device)  # [T*W, I]
    logits, top_k, tw = route if route is not None else (x, 0, x)  # unused pointers without routing
    E = logits.shape[1] - (slots - top_k) if route is not None else 0
    _pair_gate_up_kernel[(T * slots, triton.cdiv(I, cfg["BLOCK_I"]))](
        x, w_gate_up, gu[0], ids, act, logits, tw, H, I, E, w_gate_up.stride(0), gu[1], gu[2],
        logits.stride(0), SLOTS=slots, FP8=fp8, BLOCK_I=cfg["BLOCK_I"], BLOCK_K=cfg["BLOCK_K"],
        STAGES=cfg["STAGES"], num_warps=cfg["num_warps"], **_mma_args(x, fp8, cfg),
        ROUTE_K=top_k, E_P2=triton.next_power_of_2(max(E, 1)), K_P2=triton.next_power_of_2(max(top_k, 1)),
        **pdl.kw(),
    )
    return act


def _mma_args(x: torch.Tensor, fp8: bool, cfg: dict) -> dict:
    return dict(MMA=cfg.get("MMA", 0), UPCAST=int(_interpret() or x.dtype == torch.float32),
                DOT_F16=cfg.get("DOT_F16", 0) if fp8 else 0)  # BF16 weights stay exact


def _pair_down_rows(act, w_down, dn, ids, fp8: bool, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """Each pair's unweighted down projection -> y [T*W, H] fp32."""
    H, I = w_down.shape[1], w_down.shape[2]
    P = act.shape[0]
    y = torch.empty(P, H, dtype=torch.float32, device=act.device)
    _pair_down_rows_kernel[(P, triton.cdiv(H, cfg["BLOCK_H"]))](
        act, w_down, dn[0], ids, y, H, I, w_down.stride(0), dn[1], dn[2],
        FP8=fp8, BLOCK_H=cfg["BLOCK_H"], BLOCK_K=cfg["BLOCK_K"], STAGES=cfg["STAGES"],
        num_warps=cfg["num_warps"], **_mma_args(x, fp8, cfg), **pdl.kw(),
    )
    return y


def _routed_down(act, w_down, dn, logits, top_k: int, slots: int, fp8: bool, num_warps: int) -> torch.Tensor:
    """`_routed_down_kernel`: each pair's unweighted down projection, routed from the logits,
    weights loaded before the PDL wait -> y [T*W, H] fp32. num_warps: the gate/up kernel's, so the
    routing's reductions run in the same order and pick the same experts even at a near-tie."""
    H, I = w_down.shape[1], w_down.shape[2]
    P = act.shape[0]
    E = logits.shape[1] - (slots - top_k)
    y = torch.empty(P, H, dtype=torch.float32, device=act.device)
    block_h = DOWN_PRELOAD_BLOCK_H
    _routed_down_kernel[(P, triton.cdiv(H, block_h))](
        act, w_down, dn[0], logits, y, H, I, E, w_down.stride(0), dn[1], dn[2], logits.stride(0),
        SLOTS=slots, ROUTE_K=top_k, FP8=fp8, BLOCK_H=block_h, I_P2=triton.next_power_of_2(I),
        E_P2=triton.next_power_of_2(E), K_P2=triton.next_power_of_2(top_k), num_warps=num_warps, **pdl.kw(),
    )
    return y


def _pair_path(x, w_gate_up, w_down, tw, ids, gu, dn, fp8: bool, out, cfg: dict) -> None:
    T, H = x.shape
    k = ids.shape[1]
    I = w_down.shape[2]
    act = _pair_gate_up(x, w_gate_up, gu, ids, fp8, cfg)
    if cfg.get("DOWN", "rows") == "fused":
        _pair_down_kernel[(T, triton.cdiv(H, cfg["BLOCK_H"]))](
            act, w_down, dn[0], ids, tw, out, H, I, w_down.stride(0), dn[1], dn[2],
            TOP_K=k, FP8=fp8, BLOCK_H=cfg["BLOCK_H"], BLOCK_K=cfg["BLOCK_K"], STAGES=cfg["STAGES"],
            num_warps=cfg["num_warps"], **pdl.kw(),
        )
        return
    y = _pair_down_rows(act, w_down, dn, ids, fp8, cfg, x)
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block_h))](y, tw, out, H, TOP_K=k, BLOCK_H=block_h, **pdl.kw())


def _grouped_path(x, w_gate_up, w_down, tw, ids, gu, dn, fp8: bool, out, cfg: dict) -> None:
    T, H = x.shape
    E, k, I = w_gate_up.shape[0], ids.shape[1], w_down.shape[2]
    P, bm = T * k, cfg["BLOCK_M"]
    max_blocks = (P + min(E, P) * (bm - 1)) // bm
    e_p2 = triton.next_power_of_2(E)
    upcast = _interpret() or x.dtype == torch.float32
    dev = x.device
    counts = torch.zeros(2 * E, dtype=torch.int32, device=dev)  # [counts | cursor]
    ends = torch.empty(E, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(max_blocks * bm, dtype=torch.int32, device=dev)
    blk = 1024
    _count_kernel[(triton.cdiv(P, blk),)](ids, counts, P, BLOCK=blk, **pdl.kw())
    _bucket_kernel[(triton.cdiv(P, blk),)](ids, counts, counts[E:], ends, sorted_pairs, P, E,
                                           BLOCK_M=bm, E_P2=e_p2, BLOCK=blk, **pdl.kw())
    act = torch.empty(max_blocks * bm, I, dtype=x.dtype, device=dev)  # [padded rows, I], bucket order
    a8 = fp8 and os.environ.get(A8_ENV, "0") == "1"
    xa, xs = act_quant(x) if a8 else (x, x)  # e4m3 activations + scales, or x (the scales unused)
    common = dict(E_P2=e_p2, BLOCK_M=bm, BLOCK_K=128 if a8 else cfg["BLOCK_K"], FP8=fp8, UPCAST=upcast, A8=a8,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _grouped_gate_up_kernel[(max_blocks, triton.cdiv(I, cfg["GU_BLOCK_N"]))](
        xa, w_gate_up, gu[0], sorted_pairs, ends, counts, act, H, I, E, w_gate_up.stride(0), gu[1], gu[2],
        xs, T, TOP_K=k, BLOCK_N=cfg["GU_BLOCK_N"], **common, **pdl.kw(),
    )
    acts, as_ = act_quant(act) if a8 else (act, act)
    y = torch.empty(P, H, dtype=x.dtype, device=dev)  # [T*k, H], pair order
    _grouped_down_kernel[(max_blocks, triton.cdiv(H, cfg["DN_BLOCK_N"]))](
        acts, w_down, dn[0], sorted_pairs, ends, counts, y, H, I, E, w_down.stride(0), dn[1], dn[2],
        as_, act.shape[0], BLOCK_N=cfg["DN_BLOCK_N"], **common, **pdl.kw(),
    )
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block_h))](y, tw, out, H, TOP_K=k, BLOCK_H=block_h, **pdl.kw())


def moe_experts(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H] x's dtype, or e4m3
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int64/int32
    gate_up_scale: torch.Tensor | None = None,  # [E, ceil(2I/128), ceil(H/128)] fp32
    down_scale: torch.Tensor | None = None,  # [E, ceil(H/128), ceil(I/128)] fp32
    path: str | None = None,  # "pair" | "grouped": overrides the choice by T (tests, benchmarks)
    config: dict | None = None,
) -> torch.Tensor:
    """Same result as `ops.moe_experts` (its FP8 branch dequantises, then the BF16 reference)."""
    T, H = x.shape
    E, I2, H2 = w_gate_up.shape
    I = I2 // 2
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    assert x.is_contiguous(), x.stride()
    assert H2 == H and I2 == 2 * I and tuple(w_down.shape) == (E, H, I), (w_gate_up.shape, w_down.shape)
    assert w_gate_up.is_contiguous() and w_down.is_contiguous()
    fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    assert w_down.dtype == w_gate_up.dtype and (fp8 or w_gate_up.dtype == x.dtype), (w_gate_up.dtype, x.dtype)
    assert fp8 == (gate_up_scale is not None) == (down_scale is not None), "FP8 weights need both scales"
    assert topk_ids.dtype in (torch.int32, torch.int64) and topk_ids.is_contiguous() and topk_ids.dim() == 2
    assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
    assert topk_ids.shape[0] == T and topk_weights.shape == topk_ids.shape
    gu = _scale_args(gate_up_scale, w_gate_up)
    dn = _scale_args(down_scale, w_down)
    out = torch.empty_like(x)
    if T == 0:
        return out
    path = path or ("pair" if use_pair_path(T, fp8) else "grouped")
    if path == "pair":
        cfg = config or pair_config(T, fp8)
        assert not fp8 or (128 % cfg["BLOCK_K"] == 0 and 128 % cfg["BLOCK_H"] == 0), cfg
        _pair_path(x, w_gate_up, w_down, topk_weights, topk_ids, gu, dn, fp8, out, cfg)
    else:
        cfg = config or grouped_config(T, topk_ids.shape[1], E, fp8)
        assert not fp8 or 128 % cfg["BLOCK_K"] == 0
        _grouped_path(x, w_gate_up, w_down, topk_weights, topk_ids, gu, dn, fp8, out, cfg)
    return out


ROUTED_MAX_T = 4
ROUTED_ENV = "METAINFER_MOE_ROUTED"  # "0": route in its own launch and sum in `_combine_kernel`


def routed_rows_ok(T: int, fp8: bool) -> bool:
    """Whether `moe_routed_rows` serves a batch of T tokens: FP8 experts, up to ROUTED_MAX_T tokens.
    Every gate/up program repeats its token's top-k (~1.6 µs of serial work on the H200 before its
    loads), which beats the route launch it saves only where few programs run: H200 A/B
    (benchmarks/results/2026-11-30d), batch-1 decode FP8 408 -> 425 tok/s but BF16 369 -> 350, batch 8
    FP8 1,545 -> 1,529, FP8 batch 32 2,761 -> 2,549 (with ROUTED_MAX_T = 32)."""
    return fp8 and 0 < T <= ROUTED_MAX_T and os.environ.get(ROUTED_ENV, "1") != "0"


def moe_routed_rows(
    x: torch.Tensor,  # [T, H]
    router_logits: torch.Tensor,  # [T, E] (+1 column, the shared expert's gate, when shared)
    top_k: int,
    shared: bool,  # the shared expert is stored as expert E of the weights
    w_gate_up: torch.Tensor,  # [E(+1), 2I, H]
    w_down: torch.Tensor,  # [E(+1), H, I]
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing and the experts of a decode batch in two launches, the weighted sum left to the
    consumer (`norm.moe_add_rms_norm`): the gate/up kernel routes each (token, slot) itself (no
    route launch) and the down kernel writes each pair's output unweighted.
    -> (rows [T, W, H] fp32, weights [T, W] fp32), W = top_k + shared, slot order as
    `reference.route_with_shared` (or `reference.route`): sum_j weights[:, j] * rows[:, j] is the
    `moe_experts` output before its rounding to x's dtype."""
    T, H = x.shape
    E_w = w_gate_up.shape[0]
    fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    assert router_logits.shape == (T, E_w) and router_logits.stride(1) == 1, (router_logits.shape, E_w)
    assert 0 < top_k <= E_w - int(shared) and x.is_contiguous() and 0 < T <= PAIR_MAX_T, (top_k, T)
    assert w_gate_up.is_contiguous() and w_down.is_contiguous() and w_down.shape[0] == E_w
    assert fp8 == (gate_up_scale is not None) == (down_scale is not None), "FP8 weights need both scales"
    W = top_k + int(shared)
    tw = torch.empty(T, W, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, W, dtype=torch.int64, device=x.device)
    cfg = config or pair_config(T, fp8)
    assert not fp8 or (128 % cfg["BLOCK_K"] == 0 and 128 % cfg["BLOCK_H"] == 0), cfg
    act = _pair_gate_up(x, w_gate_up, _scale_args(gate_up_scale, w_gate_up), ids, fp8, cfg,
                        route=(router_logits, top_k, tw))
    dn = _scale_args(down_scale, w_down)
    if os.environ.get(DOWN_PRELOAD_ENV, "0") == "1":
        y = _routed_down(act, w_down, dn, router_logits, top_k, W, fp8, cfg["num_warps"])
    else:
        y = _pair_down_rows(act, w_down, dn, ids, fp8, cfg, x)
    return y.view(T, W, H), tw


def moe_pair_rows(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    ids: torch.Tensor,  # [T, W] int64 (e.g. from `fp8_linear.router_topk`)
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Each (token, slot)'s expert output, unweighted, by the per-pair decode kernels (gate/up, then
    down rows): -> [T, W, H] fp32, `reference.moe_expert_rows`. The weighted sum is the consumer's
    (`norm.moe_add_rms_norm`)."""
    T, H = x.shape
    W = ids.shape[1]
    fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    assert x.is_contiguous() and 0 < T <= PAIR_MAX_T and ids.is_contiguous(), (T, ids.shape)
    assert w_gate_up.is_contiguous() and w_down.is_contiguous()
    assert fp8 == (gate_up_scale is not None) == (down_scale is not None), "FP8 weights need both scales"
    cfg = config or pair_config(T, fp8)
    act = _pair_gate_up(x, w_gate_up, _scale_args(gate_up_scale, w_gate_up), ids, fp8, cfg)
    y = _pair_down_rows(act, w_down, _scale_args(down_scale, w_down), ids, fp8, cfg, x)
    return y.view(T, W, H)
