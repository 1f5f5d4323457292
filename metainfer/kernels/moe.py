"""Routed experts: out[t] = sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j].

Weights are BF16 or FP8 e4m3 with 128x128 block scales, dequantised in registers (W8A16), so
FP8 follows `ops.moe_experts`' dequantise-then-BF16 semantics. Accumulation is fp32; the
SiLU*up activation is rounded to x's dtype as in the reference (the large-T path also stores each
expert's output in x's dtype; the small-T path keeps it in fp32 until the weighted sum).
No host synchronisation and no allocation sized by device values (CUDA-graph capturable), and
no float atomics: the same inputs give the same output bits.

Small T (decode; `use_pair_path`): `_pair_gate_up_kernel` over (pair, I-block) writes
silu(gate) * up for each of the T*k (token, slot) pairs; then either `_pair_down_rows_kernel` over
(pair, H-block) writes each pair's fp32 output and `routing.combine` adds them with the routing
weights in slot order ("rows", the default), or `_pair_down_kernel` over (token, H-block) does both
("fused"). Each pair reads its expert's rows once; the loops pipeline all their loads
(`tl.range(num_stages=...)`). `moe_routed_rows` (FP8, up to ROUTED_MAX_T tokens) routes inside the
gate/up kernel and leaves the weighted sum to the next add+RMSNorm (`norm.moe_add_rms_norm`): two
launches per layer instead of four. `moe_pair_rows` (the rows of batches past that, weighted sum
left to the add+RMSNorm too) runs its FP8 down projection on `_routed_down_kernel` from the route
launch's ids: weights loaded before the PDL wait.

Large T: `moe_grouped` (pairs bucketed by expert, grouped GEMMs), picked by `use_pair_path`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metainfer.kernels import moe_grouped, pdl, routing
from metainfer.kernels.common import load_tuned, upcast_dots, wdot
from metainfer.kernels.cuda import gemv
from metainfer.settings import settings

PAIR_MAX_T = 8  # BF16 batches up to this many tokens take the per-pair path
PAIR_MAX_T_FP8 = 16  # FP8 ones (past it the grouped path's e4m3 x e4m3 GEMMs measured faster)
DOWN_PRELOAD_BLOCK_H = 32


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
    weighted sum over a token's slots is `routing.combine`'s (fixed slot order). MMA as in
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
    I_P2: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr, GU: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
):
    """`_pair_down_rows_kernel` for the routed rows path (after `_pair_gate_up_kernel` with
    ROUTE_K), its weights loaded BEFORE the PDL wait: the program finds its (token, slot)'s expert
    from the router logits itself (`routing.slot_pick`, the gate/up kernel's picks: the logits were
    written two kernels back, so they are final once this kernel launches) and loads its whole
    [BLOCK_H, I] weight tile (and block scales) while the gate/up kernel still runs; then waits,
    reads the pair's activation and reduces on the CUDA cores. y[pair, h-block] fp32.

    ROUTE_K = 0: logits_ptr holds the pairs' expert ids [T * SLOTS] int64 instead, written by the
    route launch two kernels back like the logits (`moe_pair_rows` with FP8 weights).
    GU: act_ptr holds each pair's gate and up dots in fp32 ([T * SLOTS, 2 I], cuda/gemv.cu's
    `moe_gate_up`), the activation formed here as `_pair_gate_up_kernel` forms it (bf16)."""
    pair = tl.program_id(0)
    t = pair // SLOTS
    if ROUTE_K:
        e, _, _ = routing.slot_pick(logits_ptr + t * stride_lt, E, pair - t * SLOTS, ROUTE_K, E_P2, K_P2)
    else:
        e = tl.load(logits_ptr + pair).to(tl.int64)
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
    if GU:
        g = tl.load(act_ptr + pair * 2 * I + offs_k, mask=k_mask, other=0.0)
        u = tl.load(act_ptr + pair * 2 * I + I + offs_k, mask=k_mask, other=0.0)
        a = (g * tl.sigmoid(g) * u).to(tl.bfloat16).to(tl.float32)
    else:
        a = tl.load(act_ptr + pair * I + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if FP8:
        a = a * sc
    tl.store(y_ptr + pair * H + offs_h, tl.sum(w.to(tl.float32) * a[None, :], axis=1), mask=h_mask)


# ---- launchers -----------------------------------------------------------------------------------
def pair_config(T: int, fp8: bool = False) -> dict:
    """Tiles of the per-pair path: the GPU's table's (moe_pair_<gpu>.json, else _h200; key "fp8,T" /
    "bf16,T"), else the heuristic (8-row gate/up blocks up to 4 tokens, 16 past them). DOWN: "rows" =
    per-pair down programs + combine (parallel over pairs), "fused" = one program per (token, H-block)
    looping over the slots; DOWN_WARPS / PRELOAD_BLOCK_H: the routed down kernel's warps and rows a
    program."""
    hit = load_tuned("moe_pair", settings().moe_tuned).get(f"{'fp8' if fp8 else 'bf16'},{T}")
    if hit is not None:  # measured (benchmarks/sweep_decode_kernels.py); MMA = the tensor-core variant
        return dict(hit)
    return dict(BLOCK_I=8 if T <= 4 else 16, BLOCK_H=32, BLOCK_K=128, STAGES=4, num_warps=2, DOWN="rows")


def use_pair_path(T: int, fp8: bool) -> bool:
    """Per-pair path up to PAIR_MAX_T tokens (BF16) or PAIR_MAX_T_FP8 (FP8); the grouped path past it."""
    return T <= (PAIR_MAX_T_FP8 if fp8 else PAIR_MAX_T)


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
    return dict(MMA=cfg.get("MMA", 0), UPCAST=int(upcast_dots(x)),
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


def _routed_down(act, w_down, dn, logits, top_k: int, slots: int, fp8: bool, cfg: dict,
                 gu: bool = False) -> torch.Tensor:
    """`_routed_down_kernel`: each pair's unweighted down projection, routed from the logits (or,
    top_k = 0, read from the ids [T, slots] passed as logits), weights loaded before the PDL wait
    -> y [T*W, H] fp32. cfg: the pair config; its PRELOAD_BLOCK_H rows per program (default 32) and
    DOWN_WARPS warps (default: the gate/up kernel's; any count picks the same experts, as the
    routing's picks do not depend on the reduction order: `routing.softmax_topk`). gu: act is
    [T * slots, 2 I] fp32 gate and up dots (`_routed_down_kernel`'s GU)."""
    H, I = w_down.shape[1], w_down.shape[2]
    P = act.shape[0]
    assert not gu or (act.dtype == torch.float32 and act.shape[1] == 2 * I), (act.dtype, act.shape)
    E = logits.shape[1] - (slots - top_k) if top_k else 1
    y = torch.empty(P, H, dtype=torch.float32, device=act.device)
    block_h = cfg.get("PRELOAD_BLOCK_H", DOWN_PRELOAD_BLOCK_H)
    _routed_down_kernel[(P, triton.cdiv(H, block_h))](
        act, w_down, dn[0], logits, y, H, I, E, w_down.stride(0), dn[1], dn[2], logits.stride(0),
        SLOTS=slots, ROUTE_K=top_k, FP8=fp8, BLOCK_H=block_h, I_P2=triton.next_power_of_2(I),
        E_P2=triton.next_power_of_2(E), K_P2=triton.next_power_of_2(max(top_k, 1)), GU=int(gu),
        num_warps=cfg.get("DOWN_WARPS", cfg["num_warps"]), **pdl.kw(),
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
    routing.combine(_pair_down_rows(act, w_down, dn, ids, fp8, cfg, x), tw, out)


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
        cfg = config or moe_grouped.grouped_config(T, topk_ids.shape[1], E, fp8)
        assert not fp8 or 128 % cfg["BLOCK_K"] == 0
        moe_grouped.grouped_path(x, w_gate_up, w_down, topk_weights, topk_ids, gu, dn, fp8, out, cfg)
    return out


ROUTED_MAX_T = 4  # a speculative verify of 1 + 4 tokens is just past it


def routed_rows_ok(T: int, fp8: bool) -> bool:
    """Whether `moe_routed_rows` serves a batch of T tokens: FP8 experts, up to ROUTED_MAX_T tokens.
    Every gate/up program repeats its token's top-k (serial work before its loads), which beats the
    route launch it saves only where few programs run (and not for BF16)."""
    return fp8 and 0 < T <= ROUTED_MAX_T


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
    cfg = config or pair_config(T, fp8)
    if T == 1 and shared and gemv.wanted_moe(x, router_logits, top_k, w_gate_up, gate_up_scale):
        gu, tw, _ = gemv.moe_gate_up(x, router_logits, top_k, w_gate_up, gate_up_scale)
        y = _routed_down(gu, w_down, _scale_args(down_scale, w_down), router_logits, top_k, W, fp8, cfg,
                         gu=True)
        return y.view(T, W, H), tw
    tw = torch.empty(T, W, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, W, dtype=torch.int64, device=x.device)
    assert not fp8 or (128 % cfg["BLOCK_K"] == 0 and 128 % cfg["BLOCK_H"] == 0), cfg
    act = _pair_gate_up(x, w_gate_up, _scale_args(gate_up_scale, w_gate_up), ids, fp8, cfg,
                        route=(router_logits, top_k, tw))
    y = _routed_down(act, w_down, _scale_args(down_scale, w_down), router_logits, top_k, W, fp8, cfg)
    return y.view(T, W, H), tw


def moe_pair_rows(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    ids: torch.Tensor,  # [T, W] int64 (the route launch's)
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
    assert x.is_contiguous() and 0 < T and use_pair_path(T, fp8) and ids.is_contiguous(), (T, ids.shape)
    assert w_gate_up.is_contiguous() and w_down.is_contiguous()
    assert fp8 == (gate_up_scale is not None) == (down_scale is not None), "FP8 weights need both scales"
    cfg = config or pair_config(T, fp8)
    act = _pair_gate_up(x, w_gate_up, _scale_args(gate_up_scale, w_gate_up), ids, fp8, cfg)
    dn = _scale_args(down_scale, w_down)
    if fp8:  # the weights loaded before the PDL wait (BF16: measured no faster)
        y = _routed_down(act, w_down, dn, ids, 0, W, fp8, cfg)
    else:
        y = _pair_down_rows(act, w_down, dn, ids, fp8, cfg, x)
    return y.view(T, W, H)


def grouped_rows_ok(T: int, fp8: bool) -> bool:
    """Whether `moe_grouped_rows` serves T tokens: past the per-pair path."""
    return T > 0 and not use_pair_path(T, fp8)


def moe_grouped_rows(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    ids: torch.Tensor,  # [T, W] int64/int32
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    config: dict | None = None,
    xq: tuple[torch.Tensor, torch.Tensor] | None = None,  # x's e4m3 copy (`fp8_linear.act_buffers`)
) -> torch.Tensor:
    """`moe_pair_rows` for batches past the per-pair path: the grouped GEMMs' unweighted output of
    each (token, slot), in x's dtype (as `moe_experts`' grouped path rounds them before its combine
    launch) -> [T, W, H]. The weighted sum is the consumer's (`norm.moe_add_rms_norm`: the combine
    launch saved, the same sum in the same slot order)."""
    T, H = x.shape
    E, W = w_gate_up.shape[0], ids.shape[1]
    fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    assert x.is_contiguous() and T > 0 and ids.is_contiguous() and ids.shape[0] == T, (x.shape, ids.shape)
    assert w_gate_up.is_contiguous() and w_down.is_contiguous() and w_down.shape[0] == E
    assert fp8 == (gate_up_scale is not None) == (down_scale is not None), "FP8 weights need both scales"
    cfg = config or moe_grouped.grouped_config(T, W, E, fp8)
    assert not fp8 or 128 % cfg["BLOCK_K"] == 0
    y = moe_grouped.grouped_rows(x, w_gate_up, w_down, ids, _scale_args(gate_up_scale, w_gate_up),
                                 _scale_args(down_scale, w_down), fp8, cfg, xq=xq)
    return y.view(T, W, H)
