"""RMSNorm kernels: Qwen's x / rms(x) * (1 + w), the fused residual add + norm (with the MoE experts'
weighted sum, or followed by the MoE router's projection in the same launch: `add_rms_norm_router`),
and the DeltaNet gated norm (plain w, times silu(z)). fp32 math; outputs in x's dtype.

Rows are normalised over the last dim. Inputs may be strided views with up to two leading dims
(q/k head views of a projection output) as long as the last dim is contiguous; outputs are
contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metainfer.kernels import pdl
from metainfer.kernels.common import gated_norm
from metainfer.kernels.fp8_linear import BLOCK as QBLOCK
from metainfer.kernels.fp8_linear import quant_groups

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# elements per program (rows * padded row length) and warps; tuned on H200 by benchmarks/kernels_a.py
ROW_ELEMS = 4096
NUM_WARPS = 4
# add_rms_norm_router: router rows per program (the MoE router's 257: 129 programs, one wave) and the
# most rows (tokens) it takes (a decode step's few; past it the separate norm and router measured faster)
ROUTER_BLOCK_E = 2
ROUTER_MAX_T = 8


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,
    n_rows, R2, sx0, sx1, N, eps,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl.wait(USE_PDL)
    # x: [R1, R2, N] with strides (sx0, sx1, 1); out: [R1 * R2, N] contiguous
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    xoff = (rows // R2).to(tl.int64) * sx0 + (rows % R2).to(tl.int64) * sx1
    x = tl.load(x_ptr + xoff[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)  # [BLOCK_R]
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * (1.0 + w)[None, :]
    ooff = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptr + ooff, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quant_stored(out_ptr, q_ptr, s_ptr, row_off, s_off, n_s, rmask, N, BLOCK_N: tl.constexpr):
    """The e4m3 copy of the rows this program just stored at out_ptr + row_off (N columns, N % 128 == 0)
    into q (the same offsets) and their scales (group g of a row at s_ptr + s_off + g * n_s). The rows
    are read back after a barrier, not reshaped in registers: a [R, G, 128] view of the norm's own
    values made Triton lay out (and so round) the norm's reduction differently from the kernel without
    the copy (a few output elements in millions differed)."""
    G: tl.constexpr = BLOCK_N // 128  # the checkpoint's 128-column activation groups
    g = tl.arange(0, G)
    cols = g[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]  # [1, G, 128]
    offs = row_off[:, None, None] + cols
    mask = rmask[:, None, None] & (cols < N)
    tl.debug_barrier()  # every thread's share of the rows is stored (and visible to the block)
    y = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q, scale = quant_groups(y)  # [R, G, 128], [R, G]
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(s_ptr + s_off[:, None] + g[None, :] * n_s, scale, mask=rmask[:, None] & (g * 128 < N)[None, :])


@triton.jit
def _store_residual_and_norm(r, new_res_ptr, out_ptr, w_ptr, off, cols, cmask, rows, rmask, N, eps,
                             q_ptr, s_ptr, n_s, QUANT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores the new residual r (already in its dtype) and y = x / rms(x) * (1 + w) of it (rows where
    rmask), and returns y (every row); QUANT: also the output's e4m3 copy q [rows, N] and its
    per-128-column scales s [N/128, n_s] (N % 128 == 0),
    as `fp8_linear.act_quant` of the stored output gives them."""
    mask = rmask[:, None] & cmask[None, :]
    tl.store(new_res_ptr + off, r, mask=mask)
    rf = r.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(rf * rf, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = (rf * rstd[:, None] * (1.0 + w)[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + off, y, mask=mask)
    if QUANT:
        _quant_stored(out_ptr, q_ptr, s_ptr, rows.to(tl.int64) * N, rows, n_s, rmask, N, BLOCK_N)
    return y


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    n_rows, sx0, sr0, N, eps, q_ptr, s_ptr, n_s,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
):
    pdl.wait(USE_PDL)
    # x, res: [n_rows, N] with row strides sx0, sr0; out, new_res: [n_rows, N] contiguous
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    rmask = rows < n_rows
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * sx0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + rows64 * sr0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    off = rows64 * N + cols[None, :]
    r = (x + res).to(new_res_ptr.dtype.element_ty)  # the residual stream is rounded before the norm
    _store_residual_and_norm(r, new_res_ptr, out_ptr, w_ptr, off, cols, cmask, rows, rmask, N, eps,
                             q_ptr, s_ptr, n_s, QUANT, BLOCK_N)


@triton.jit
def _add_rms_norm_router_kernel(
    x_ptr, res_ptr, w_ptr, rw_ptr, out_ptr, new_res_ptr, logits_ptr,
    n_rows, sx0, sr0, N, E, eps,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr = 0,
):
    """`_add_rms_norm_kernel` of all n_rows <= BLOCK_R rows, then the MoE router of its output:
    logits [n_rows, E] = out @ rw^T (rw [E, N] in out's dtype; fp32 sums rounded to logits' dtype, as
    the router's linear gives them). Program p owns router rows [p * BLOCK_E, (p + 1) * BLOCK_E) and
    loads them before the PDL wait (weights); every program normalises the few rows itself (L2 hits)
    and program 0 stores out and new_res. One launch and one wave in place of two launches."""
    pid = tl.program_id(0)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    cols = tl.arange(0, BLOCK_N)
    wr = tl.load(rw_ptr + offs_e.to(tl.int64)[:, None] * N + cols[None, :],
                 mask=(offs_e < E)[:, None] & (cols < N)[None, :], other=0.0)
    pdl.wait(USE_PDL)
    emask = offs_e < E
    cmask = cols < N
    rows = tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * sx0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + rows64 * sr0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = (x + res).to(new_res_ptr.dtype.element_ty)
    off = rows64 * N + cols[None, :]
    smask = rows < tl.where(pid == 0, n_rows, 0)  # program 0 stores the rows
    y = _store_residual_and_norm(r, new_res_ptr, out_ptr, w_ptr, off, cols, cmask, rows, smask, N, eps, None,
                                 None, 0, 0, BLOCK_N).to(tl.float32)
    wf = wr.to(tl.float32)
    for t in tl.static_range(BLOCK_R):  # row t of y (a masked sum picks it) against this program's rows
        if t < n_rows:
            yt = tl.sum(tl.where(rows[:, None] == t, y, 0.0), axis=0)
            lg = tl.sum(wf * yt[None, :], axis=1)
            tl.store(logits_ptr + t * E + offs_e, lg.to(logits_ptr.dtype.element_ty), mask=emask)


@triton.jit
def _moe_add_rms_norm_kernel(
    y_ptr, tw_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    n_rows, sr0, N, eps, q_ptr, s_ptr, n_s,
    SLOTS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr = 0, USE_PDL: tl.constexpr = 0,
):
    """`_add_rms_norm_kernel` whose x is the weighted sum of SLOTS rows per token (the MoE experts'
    outputs: fp32 from the per-pair kernels, the model dtype from the grouped ones): x = sum_j
    tw[t, j] * y[t, j] in fp32 and slot order, rounded to the residual's dtype, as
    `routing.combine` writes it."""
    pdl.wait(USE_PDL)
    # y: [n_rows, SLOTS, N] fp32/bf16/fp16; tw: [n_rows, SLOTS] fp32; res: [n_rows, N] row stride sr0
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    rmask = rows < n_rows
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for j in tl.static_range(SLOTS):
        y = tl.load(y_ptr + (rows64 * SLOTS + j) * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x += tl.load(tw_ptr + rows * SLOTS + j, mask=rmask, other=0.0)[:, None] * y
    r = x.to(new_res_ptr.dtype.element_ty)
    if HAS_RES:
        res = tl.load(res_ptr + rows64 * sr0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = (r.to(tl.float32) + res).to(new_res_ptr.dtype.element_ty)
    off = rows64 * N + cols[None, :]
    _store_residual_and_norm(r, new_res_ptr, out_ptr, w_ptr, off, cols, cmask, rows, rmask, N, eps,
                             q_ptr, s_ptr, n_s, QUANT, BLOCK_N)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr,
    n_rows, R2, sx0, sx1, sz0, sz1, N, eps, q_ptr, s_ptr, n_s,
    MID: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
):
    """QUANT: also the output's e4m3 copy, as `fp8_linear.act_quant` of out viewed [R1, R2 * N] gives
    it (q like out; scales [R2 * N / 128, n_s]; N % 128 == 0: a head's row is whole groups)."""
    pdl.wait(USE_PDL)
    # x, z: [R1, R2, N] strided (last dim contiguous); out: [R1 * R2, N] contiguous
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    r1 = (rows // R2).to(tl.int64)
    r2 = (rows % R2).to(tl.int64)
    x = tl.load(x_ptr + (r1 * sx0 + r2 * sx1)[:, None] + cols[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + (r1 * sz0 + r2 * sz1)[:, None] + cols[None, :], mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = gated_norm(x, z, w, eps, N, 1, MID)  # out is in x's dtype
    ooff = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptr + ooff, y, mask=mask)
    if QUANT:  # scale of (row r1, column group r2 * N / 128 + g) at [r2 * N / 128 + g, r1]
        _quant_stored(out_ptr, q_ptr, s_ptr, rows.to(tl.int64) * N, r2 * (N // 128) * n_s + r1, n_s,
                      rows < n_rows, N, BLOCK_N)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[..., N] with at most two leading dims -> [R1, R2, N] view."""
    assert x.dim() in (1, 2, 3), f"expected 1-3 dims, got {tuple(x.shape)}"
    if x.dim() == 1:
        return x[None, None]
    if x.dim() == 2:
        return x[:, None]
    return x


def _tile(n_cols: int) -> tuple[int, int]:
    block_n = triton.next_power_of_2(n_cols)
    return max(1, ROW_ELEMS // block_n), block_n


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] (last dim contiguous, <= 2 leading dims), weight [N] -> x / rms(x) * (1 + w)."""
    N = x.shape[-1]
    assert x.stride(-1) == 1, "last dim of x must be contiguous"
    assert weight.shape == (N,) and weight.is_contiguous(), (weight.shape, N)
    assert x.dtype in _TL_DTYPE and weight.device == x.device
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x3 = _as_3d(x)
    n_rows = x3.shape[0] * x3.shape[1]
    block_r, block_n = _tile(N)
    _rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x3, weight, out, n_rows, x3.shape[1], x3.stride(0), x3.stride(1), N, eps,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=NUM_WARPS, **pdl.kw(),
    )
    return out


def _quant_args(xq_out, T: int, N: int, device) -> dict:
    """The kernels' (q_ptr, s_ptr, n_s, QUANT) for an `xq_out` = (q [Tp, N] e4m3, s [N/128, Tp] fp32),
    Tp >= T (rows past T are the caller's), or none."""
    if xq_out is None:
        return dict(q_ptr=None, s_ptr=None, n_s=0, QUANT=0)
    q, s = xq_out
    Tp = q.shape[0]
    assert N % QBLOCK == 0 and Tp >= T and q.shape == (Tp, N) and q.dtype == torch.float8_e4m3fn, q.shape
    assert s.shape == (N // QBLOCK, Tp) and s.dtype == torch.float32, s.shape
    assert q.is_contiguous() and s.is_contiguous()
    assert q.device == s.device == device
    return dict(q_ptr=q, s_ptr=s, n_s=Tp, QUANT=1)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    xq_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, N] -> (rms_norm(x + residual), x + residual); residual None: (rms_norm(x), x).
    xq_out (with a residual): (q [Tp, N], s [N/128, Tp]) get the output's e4m3 copy as
    `fp8_linear.act_quant` gives it, rows < T (`fp8_linear.act_buffers`)."""
    if residual is None:
        assert xq_out is None, "xq_out needs the residual add"
        return rms_norm(x, weight, eps), x
    assert x.dim() == 2 and x.stride(1) == 1 and residual.stride(-1) == 1, "x, residual: [T, N], N contiguous"
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
    T, N = x.shape
    assert weight.shape == (N,) and weight.is_contiguous() and x.dtype in _TL_DTYPE
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    new_res = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out, new_res
    block_r, block_n = _tile(N)
    _add_rms_norm_kernel[(triton.cdiv(T, block_r),)](
        x, residual, weight, out, new_res, T, x.stride(0), residual.stride(0), N, eps,
        **_quant_args(xq_out, T, N, x.device), BLOCK_R=block_r, BLOCK_N=block_n, num_warps=NUM_WARPS,
        **pdl.kw(),
    )
    return out, new_res


def router_ok(T: int, dtype: torch.dtype, router_dtype: torch.dtype) -> bool:
    """Whether `add_rms_norm_router` takes T rows of x in `dtype` and a router in `router_dtype`: a decode
    step's few rows (up to ROUTER_MAX_T), an unquantised router in x's dtype."""
    return 0 < T <= ROUTER_MAX_T and dtype in _TL_DTYPE and router_dtype == dtype


def add_rms_norm_router(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, router_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual [T, N] (rows contiguous), router_weight [E, N] contiguous, `router_ok` -> (rms_norm(x +
    residual), x + residual, logits [T, E] in x's dtype = the first @ router_weight^T), in one launch of
    cdiv(E, ROUTER_BLOCK_E) programs."""
    assert x.dim() == 2 and router_ok(x.shape[0], x.dtype, router_weight.dtype), (x.shape, router_weight)
    assert x.stride(1) == 1 and residual.stride(-1) == 1, (x.stride(), residual.stride())
    assert router_weight.is_contiguous() and router_weight.shape[1] == x.shape[1], router_weight.shape
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
    T, N = x.shape
    E = router_weight.shape[0]
    assert weight.shape == (N,) and weight.is_contiguous(), weight.shape
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    new_res = torch.empty(T, N, dtype=x.dtype, device=x.device)
    logits = torch.empty(T, E, dtype=x.dtype, device=x.device)
    block_r = triton.next_power_of_2(T)
    warps = 4 if block_r <= 2 else 8
    _add_rms_norm_router_kernel[(triton.cdiv(E, ROUTER_BLOCK_E),)](
        x, residual, weight, router_weight, out, new_res, logits, T, x.stride(0), residual.stride(0), N, E,
        eps,
        BLOCK_R=block_r, BLOCK_N=triton.next_power_of_2(N), BLOCK_E=ROUTER_BLOCK_E, num_warps=warps,
        **pdl.kw(),
    )
    return out, new_res, logits


def moe_add_rms_norm(
    rows: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
    eps: float, dtype: torch.dtype | None = None, xq_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    res_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [T, W, N] (fp32, or the grouped path's x dtype), weights [T, W] fp32: x = sum_j
    weights[:, j] * rows[:, j] in fp32, rounded to the residual's dtype (or `dtype`), then
    `add_rms_norm(x, residual)`, in one launch (xq_out: as there; res_out: the new residual's buffer,
    [T, N] contiguous)."""
    assert rows.dim() == 3 and rows.is_contiguous() and rows.dtype in _TL_DTYPE, (rows.shape, rows.dtype)
    T, W, N = rows.shape
    assert weights.shape == (T, W) and weights.is_contiguous() and weights.dtype == torch.float32
    dt = residual.dtype if residual is not None else dtype
    assert dt in (torch.bfloat16, torch.float16, torch.float32), "need the residual or a dtype"
    if residual is not None:
        assert residual.shape == (T, N) and residual.stride(1) == 1, (residual.shape, residual.stride())
    assert weight.shape == (N,) and weight.is_contiguous()
    out = torch.empty(T, N, dtype=dt, device=rows.device)
    new_res = torch.empty(T, N, dtype=dt, device=rows.device) if res_out is None else res_out
    assert new_res.shape == (T, N) and new_res.dtype == dt and new_res.is_contiguous(), (new_res.shape, dt)
    if T == 0:
        return out, new_res
    block_r, block_n = _tile(N)
    res = residual if residual is not None else new_res  # unused pointer without a residual
    _moe_add_rms_norm_kernel[(triton.cdiv(T, block_r),)](
        rows, weights, res, weight, out, new_res, T, res.stride(0), N, eps,
        **_quant_args(xq_out, T, N, rows.device), SLOTS=W, HAS_RES=residual is not None, BLOCK_R=block_r,
        BLOCK_N=block_n, num_warps=NUM_WARPS, **pdl.kw(),
    )
    return out, new_res


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   xq_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x, z [T, Hv, Dv] (last dim contiguous), weight [Dv] -> (w * x / rms(x)) * silu(z) per head.
    xq_out: buffers (`fp8_linear.act_buffers(T, Hv * Dv)`) that also get the output's e4m3 copy, as
    act_quant of the output viewed [T, Hv * Dv] gives it (Dv % 128 == 0)."""
    N = x.shape[-1]
    assert x.shape == z.shape and x.dtype == z.dtype, (x.shape, z.shape, x.dtype, z.dtype)
    assert x.stride(-1) == 1 and z.stride(-1) == 1, "last dims of x and z must be contiguous"
    assert weight.shape == (N,) and weight.is_contiguous() and x.dtype in _TL_DTYPE
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x3, z3 = _as_3d(x), _as_3d(z)
    n_rows = x3.shape[0] * x3.shape[1]
    block_r, block_n = _tile(N)
    mid = _TL_DTYPE[torch.promote_types(weight.dtype, x.dtype)]
    assert xq_out is None or (block_n == N and N % 128 == 0 and x.dim() == 3), "xq_out: [T, Hv, 128 * 2^k]"
    _gated_rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x3, z3, weight, out, n_rows, x3.shape[1], x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1),
        N, eps, **_quant_args(xq_out, x3.shape[0], x3.shape[1] * N, x.device), MID=mid, BLOCK_R=block_r,
        BLOCK_N=block_n, num_warps=NUM_WARPS, **pdl.kw(),
    )
    return out
