"""A decode batch's MoE block in one launch: routing, gate/up, SiLU*up, down and the weighted sum.

`_pair_gate_up_kernel` and `_routed_down_kernel` (moe.py) are two dependent launches per layer and
leave the weighted sum of the 9 (token, slot) rows to the next norm. Here each program owns BLOCK_I
intermediate rows of one (token, slot)'s expert: it routes the token itself (`routing.softmax_topk`,
the same picks), computes those rows' silu(gate) * up from its weights, multiplies them into the
matching BLOCK_I columns of the expert's down projection, and adds its share of the weighted output
to the token's accumulator. So the gate/up -> down dependency stays inside the program and the
layer's MoE is one launch: the `_routed_down_kernel` launch (40 per batch-1 step) goes.

The shares are summed with integer atomics on a fixed-point accumulator, acc = round-toward-zero(
value * 2^32) as int64: integer addition is associative, so the sum is the same bits whatever the
order the programs arrive in (no float atomics: the same inputs give the same output). Range: the
MoE output of a token must stay below 2^31 in magnitude (activations are O(1)-O(1e4)); resolution
2^-32 per share, far below the fp32 rounding of each share. The accumulator is consumed (and left
at zero) by the next add+RMSNorm, `norm.moe_acc_add_rms_norm`.

H_SPLIT > 1 gives each (slot, I-block) H_SPLIT programs, each with 1/H_SPLIT of the down rows: the
gate/up rows are read H_SPLIT times (the repeats hit L2: the programs run at once), which spreads a
batch-1 layer over more SMs without narrowing the down tile's contiguous BLOCK_I-byte row segments.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from metainfer.kernels import pdl, routing
from metainfer.kernels.common import env_int, load_tuned, upcast_dots, wdot

FIXED_POINT_SCALE = 4294967296.0  # 2^32: acc = value * 2^32 as int64
_SCALE = tl.constexpr(FIXED_POINT_SCALE)  # the same, inside the kernel
ENV = "METAINFER_MOE_FUSED"  # "1": decode batches of up to FUSED_MAX_T tokens take the fused block
MAX_T_ENV = "METAINFER_MOE_FUSED_MAX_T"
FUSED_MAX_T = 4


@triton.jit
def _fused_moe_kernel(
    x_ptr, wgu_ptr, sgu_ptr, wd_ptr, sd_ptr, logits_ptr, acc_ptr,
    H, I, E, stride_wgu, stride_sgu_e, stride_sgu_n, stride_wd, stride_sd_e, stride_sd_n, stride_lt,
    SLOTS: tl.constexpr, ROUTE_K: tl.constexpr, FP8: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, H_SPLIT: tl.constexpr,
    STAGES: tl.constexpr, MMA: tl.constexpr, UPCAST: tl.constexpr, DOT_F16: tl.constexpr,
    E_P2: tl.constexpr, K_P2: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """Grid (T * SLOTS, cdiv(I, BLOCK_I), H_SPLIT). x [T, H]; wgu [E(+1), 2I, H] (gate rows, then up);
    wd [E(+1), H, I]; FP8: e4m3 with fp32 block scales sgu [., 2I/128, H/128], sd [., H/128, I/128]
    (BLOCK_I, BLOCK_K, BLOCK_H divide 128: one scale per tile row block and step); logits [T, E (+1)]
    (column E gates the shared expert, slot ROUTE_K, id E); acc [T, H] int64 fixed point, added to.

    Slot j < ROUTE_K: the token's (j+1)-th pick, weight its probability over the sum of the ROUTE_K
    picks' (`reference.route`); slot ROUTE_K: the shared expert, weight sigmoid(logit E). The
    activation silu(g) * u is rounded to x's dtype, as `reference.moe_expert_rows` does. MMA: both
    products on the tensor cores against a 16-column operand holding the vector in column 0
    (`common.wdot`); otherwise fp32 FMAs on the CUDA cores."""
    pdl.wait(USE_PDL)
    pair = tl.program_id(0)
    t = pair // SLOTS
    j = pair - t * SLOTS
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = offs_i < I
    lrow = logits_ptr + t * stride_lt
    vals, idx = routing.softmax_topk(lrow, E, tl.where(j < ROUTE_K, ROUTE_K, 0), E_P2, K_P2)
    slot = tl.arange(0, K_P2)
    if j < ROUTE_K:
        e = tl.sum(tl.where(slot == j, idx, 0), axis=0).to(tl.int64)
        wgt = tl.sum(tl.where(slot == j, vals, 0.0), axis=0) / tl.sum(vals, axis=0)
    else:
        e = E.to(tl.int64)
        wgt = tl.sigmoid(tl.load(lrow + E).to(tl.float32))

    # silu(gate) * up of rows offs_i: [BLOCK_I]
    x_row = x_ptr + t * H
    wg_rows = wgu_ptr + e * stride_wgu + offs_i[:, None] * H  # gate rows; the up rows at + I * H
    sgu = sgu_ptr + e * stride_sgu_e
    col = tl.arange(0, 16)
    ACC_N: tl.constexpr = 16 if MMA else BLOCK_K
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
            pg = wg.to(tl.float32) * xv.to(tl.float32)[None, :]
            pu = wu.to(tl.float32) * xv.to(tl.float32)[None, :]
        if FP8:  # one scale column per step (BLOCK_K divides 128), one scale row per tile (BLOCK_I too)
            sg = tl.load(sgu + (offs_i // 128) * stride_sgu_n + k0 // 128, mask=i_mask, other=0.0)
            su = tl.load(sgu + ((offs_i + I) // 128) * stride_sgu_n + k0 // 128, mask=i_mask, other=0.0)
            pg = pg * sg[:, None]
            pu = pu * su[:, None]
        acc_g += pg
        acc_u += pu
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    a = tl.where(i_mask, g * tl.sigmoid(g) * u, 0.0).to(x_ptr.dtype.element_ty)  # [BLOCK_I]

    # this program's down rows: its share of the weighted output, into the accumulator
    h_per = tl.cdiv(tl.cdiv(H, H_SPLIT), BLOCK_H) * BLOCK_H
    h_lo = tl.program_id(2) * h_per
    h_hi = tl.minimum(h_lo + h_per, H)
    wd_cols = wd_ptr + e * stride_wd + offs_i[None, :]  # [1, BLOCK_I]
    sd = sd_ptr + e * stride_sd_e + (tl.program_id(1) * BLOCK_I) // 128
    if MMA:
        ab = tl.where(col[None, :] == 0, a[:, None], 0.0).to(a.dtype)  # [BLOCK_I, 16]
    acc_row = acc_ptr + t * H
    for h0 in tl.range(h_lo, h_hi, BLOCK_H, num_stages=STAGES):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < h_hi
        w = tl.load(wd_cols + offs_h[:, None] * I, mask=h_mask[:, None] & i_mask[None, :], other=0.0)
        if MMA:
            p = tl.sum(wdot(w, ab, UPCAST, DOT_F16), axis=1)  # [BLOCK_H]: column 0 holds the product
        else:
            p = tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
        if FP8:
            p = p * tl.load(sd + (h0 // 128) * stride_sd_n)
        q = (p * wgt * _SCALE).to(tl.int64)
        tl.atomic_add(acc_row + offs_h, q, mask=h_mask, sem="relaxed", scope="gpu")


# ---- launcher ------------------------------------------------------------------------------------
def enabled() -> bool:
    return os.environ.get(ENV, "0") == "1"


def max_t() -> int:
    return env_int(MAX_T_ENV, FUSED_MAX_T, 0, 16)


def fused_ok(T: int) -> bool:
    """Whether `moe_fused_sum` serves a decode batch of T tokens: METAINFER_MOE_FUSED=1 and T up to
    METAINFER_MOE_FUSED_MAX_T (default FUSED_MAX_T)."""
    return enabled() and 0 < T <= max_t()


def fused_config(T: int, fp8: bool) -> dict:
    """Tiles: the H200 table's "fused:fp8,T" / "fused:bf16,T" (benchmarks/moe_bs1_probe.py --parts
    fused), else 64 intermediate rows per program on the tensor cores, the down rows split 2 ways."""
    hit = load_tuned("moe_pair_h200.json", "METAINFER_MOE_TUNED").get(f"fused:{'fp8' if fp8 else 'bf16'},{T}")
    if hit is not None:
        return dict(hit)
    return dict(BLOCK_I=64, BLOCK_K=128, BLOCK_H=128, H_SPLIT=2, STAGES=3, num_warps=4, MMA=1, DOT_F16=1)


_ACC: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def accumulator(device: torch.device, T: int, H: int) -> torch.Tensor:
    """The zeroed int64 [T, H] accumulator of T-token steps on `device`. One per shape: a step's MoE
    output is consumed (and zeroed) by the next norm before the next MoE block runs, so one buffer
    serves every layer. Made on the first call (the eager warm-up, before any CUDA-graph capture)."""
    key = (device, T, H)
    buf = _ACC.get(key)
    if buf is None:
        buf = torch.zeros(T, H, dtype=torch.int64, device=device)
        _ACC[key] = buf
    return buf


def _scales(scale: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    if scale is None:
        return w, 0, 0  # unused pointer
    E, N, K = w.shape
    assert scale.dtype == torch.float32 and scale.is_contiguous(), (scale.dtype, scale.stride())
    assert tuple(scale.shape) == (E, triton.cdiv(N, 128), triton.cdiv(K, 128)), scale.shape
    return scale, scale.stride(0), scale.stride(1)


def moe_fused_sum(
    x: torch.Tensor,  # [T, H]
    router_logits: torch.Tensor,  # [T, E] (+1 column, the shared expert's gate, when shared)
    top_k: int,
    shared: bool,  # the shared expert is stored as expert E of the weights
    w_gate_up: torch.Tensor,  # [E(+1), 2I, H]
    w_down: torch.Tensor,  # [E(+1), H, I]
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    config: dict | None = None,
    acc: torch.Tensor | None = None,  # [T, H] int64, zero on entry (default: `accumulator`)
) -> torch.Tensor:
    """The MoE block's output sum_j w[t, j] * expert_j(x[t]) (`reference.moe_experts` with
    `reference.route_with_shared` / `route`) as fixed-point int64 [T, H] (value * FIXED_POINT_SCALE),
    in one launch. The caller consumes it with `norm.moe_acc_add_rms_norm`, which leaves it zeroed."""
    T, H = x.shape
    E_w, I2, H2 = w_gate_up.shape
    I = I2 // 2
    fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    assert x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    assert H2 == H and tuple(w_down.shape) == (E_w, H, I), (w_gate_up.shape, w_down.shape)
    assert w_gate_up.is_contiguous() and w_down.is_contiguous() and w_down.dtype == w_gate_up.dtype
    assert fp8 or w_gate_up.dtype == x.dtype, (w_gate_up.dtype, x.dtype)
    assert fp8 == (gate_up_scale is not None) == (down_scale is not None), "FP8 weights need both scales"
    assert router_logits.shape == (T, E_w) and router_logits.stride(1) == 1, (router_logits.shape, E_w)
    E = E_w - int(shared)
    assert 0 < top_k <= E, (top_k, E)
    cfg = config or fused_config(T, fp8)
    bi, bk, bh = cfg["BLOCK_I"], cfg["BLOCK_K"], cfg["BLOCK_H"]
    assert not fp8 or (128 % bi == 0 and 128 % bk == 0 and 128 % bh == 0), cfg
    assert not cfg["MMA"] or min(bi, bk, bh) >= 16, cfg  # tl.dot's smallest operand sides
    if acc is None:
        acc = accumulator(x.device, T, H)
    assert acc.shape == (T, H) and acc.dtype == torch.int64 and acc.is_contiguous(), (acc.shape, acc.dtype)
    if T == 0:
        return acc
    gu, dn = _scales(gate_up_scale, w_gate_up), _scales(down_scale, w_down)
    slots = top_k + int(shared)
    _fused_moe_kernel[(T * slots, triton.cdiv(I, bi), cfg["H_SPLIT"])](
        x, w_gate_up, gu[0], w_down, dn[0], router_logits, acc,
        H, I, E, w_gate_up.stride(0), gu[1], gu[2], w_down.stride(0), dn[1], dn[2], router_logits.stride(0),
        SLOTS=slots, ROUTE_K=top_k, FP8=fp8, BLOCK_I=bi, BLOCK_K=bk, BLOCK_H=bh, H_SPLIT=cfg["H_SPLIT"],
        STAGES=cfg["STAGES"], MMA=cfg["MMA"], UPCAST=int(upcast_dots(x)),
        DOT_F16=cfg.get("DOT_F16", 0) if fp8 else 0, E_P2=triton.next_power_of_2(E),
        K_P2=triton.next_power_of_2(top_k), num_warps=cfg["num_warps"], **pdl.kw(),
    )
    return acc
