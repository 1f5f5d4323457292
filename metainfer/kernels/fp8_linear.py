"""FP8 block-scaled linear: y = x W^T, W [N, K] e4m3 with fp32 scale_inv [ceil(N/128), ceil(K/128)].

The token count T picks the kernel:
- T <= 16 (decode; `weight_stream.FP8_STREAM_MAX_T`): the
  weight-streaming kernels read every weight tile once, dequantised in registers (W8A16);
- larger T (wider decode batches, prefill): activations are quantised per token and 128-column group
  (`_act_quant_kernel`, the published checkpoint's dynamic activation scheme), then `_w8a8_kernel`
  runs the FP8 tensor-core GEMM and applies both scales to the fp32 accumulator per 128-wide K
  block. On sm_90 with torch >= 2.9 (the H200) this case runs torch._scaled_mm's blockwise (1x128,
  128x128) cuBLASLt recipe instead (faster there).

`linear_conv_update`: the DeltaNet in_proj (FP8 or BF16 weights) with its decode conv, picked likewise.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from metainfer.kernels import conv1d, pdl
from metainfer.kernels.common import interpreting, mma
from metainfer.kernels.cuda import gemv
from metainfer.kernels.weight_stream import (
    FP8_STREAM_MAX_T,
    SKINNY_MAX_T,
    dense_linear,
    stream_config,
    stream_linear,
)

FP8_MAX = 448.0
BLOCK = 128  # the checkpoint's weight_block_size


# ---- kernels -------------------------------------------------------------------------------------
@triton.jit
def _round_e4m3(v):
    """Rounds fp32 to the nearest e4m3 value (ties to even), saturating at +-448, still as fp32.

    The later cast to float8e4nv is then exact on every backend (the interpreter's own rounding
    drops the carry into the exponent)."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep sign, exponent, 3 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (v + 24576.0) - 24576.0  # multiples of 2^-9 below 2^-6
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def quant_groups(x):
    """x [R, G, 128] fp32 -> (q [R, G, 128] e4m3, s [R, G] fp32): s = amax / 448 per row and group,
    q = e4m3(x / s): `quant_tile`'s arithmetic on G column groups at once (the norms that write their
    output's e4m3 copy; tests assert both give the same bits)."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-12) / 448.0
    return _round_e4m3(x / scale[:, :, None]).to(tl.float8e4nv), scale


@triton.jit
def quant_tile(x_ptr, q_ptr, s_ptr, offs_t, t_mask, T, K, stride_xt, kb):
    """Rows offs_t (where t_mask) of x, column group kb: s = amax / 448, q = e4m3(x / s); s is stored
    [ceil(K/128), T]. The one definition of the activation scheme (`_act_quant_kernel`, and the
    grouped MoE's quantisation of its valid rows only)."""
    offs_k = kb * 128 + tl.arange(0, 128)
    mask = t_mask[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
    q = _round_e4m3(x / scale[:, None])
    tl.store(q_ptr + offs_t[:, None] * K + offs_k[None, :], q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + kb * T + offs_t, scale, mask=t_mask)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_xt, BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """Per token and 128-column group: s = amax / 448, q = e4m3(x / s). s is stored [ceil(K/128), T]."""
    pdl.wait(USE_PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    quant_tile(x_ptr, q_ptr, s_ptr, offs_t, offs_t < T, T, K, stride_xt, tl.program_id(1))


@triton.jit
def _w8a8_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_wsn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl.wait(USE_PDL)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % size_m)
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, 128)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(tl.cdiv(K, 128)):
        k = kb * 128 + offs_k
        k_mask = k < K
        a_mask = m_mask[:, None] & k_mask[None, :]
        b_mask = n_mask[:, None] & k_mask[None, :]
        a = tl.load(a_ptr + offs_m[:, None] * K + k[None, :], mask=a_mask, other=0.0)  # [BLOCK_M, 128] e4m3
        b = tl.load(w_ptr + offs_n[:, None] * K + k[None, :], mask=b_mask, other=0.0)  # [BLOCK_N, 128] e4m3
        sa = tl.load(as_ptr + kb * M + offs_m, mask=m_mask, other=0.0)
        sb = tl.load(ws_ptr + (offs_n // 128) * stride_wsn + kb, mask=n_mask, other=0.0)
        acc += mma(a, tl.trans(b), UPCAST) * (sa[:, None] * sb[None, :])
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# ---- launchers -----------------------------------------------------------------------------------
def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] e4m3, s [ceil(K/128), T] fp32) with x ~ q * s per 128-column group."""
    T, K = x.shape
    assert x.stride(-1) == 1
    q = torch.empty(T, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(triton.cdiv(K, BLOCK), T, dtype=torch.float32, device=x.device)
    block_t = 16 if T >= 16 else triton.next_power_of_2(T)
    grid = (triton.cdiv(T, block_t), triton.cdiv(K, BLOCK))
    _act_quant_kernel[grid](x, q, s, T, K, x.stride(0), BLOCK_T=block_t, **pdl.kw())
    return q, s


@functools.cache
def _cublas_blockwise() -> bool:
    """cuBLASLt's blockwise-scaled FP8 GEMM is there: torch >= 2.9 on compute capability 9.0."""
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 9) and torch.cuda.get_device_capability() == (9, 0)


def _use_cublas() -> bool:
    """The W8A8 GEMM of a CUDA step on cuBLAS (else `_w8a8_kernel`)."""
    return _cublas_blockwise()


def gemm_config(M: int, N: int) -> dict:
    if M <= 128:
        return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4)


def act_rows(T: int) -> int:
    """Rows of the cuBLAS path's e4m3 activations for T tokens: T rounded up to a multiple of 4."""
    return T + (-T % 4)


def act_buffers(T: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [Tp, K] e4m3, s [K/128, Tp] fp32), Tp = act_rows(T), for a norm to fill rows < T
    (`norm.add_rms_norm(xq_out=...)`); the padding rows are zeros, as the W8A8 GEMM pads a step
    (their outputs are dropped)."""
    Tp = act_rows(T)
    q = torch.empty(Tp, K, dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty(triton.cdiv(K, BLOCK), Tp, dtype=torch.float32, device=device)
    if Tp > T:
        q[T:].zero_()
        s[:, T:].fill_(1e-12 / FP8_MAX)
    return q, s


def norm_quant_wanted(T: int, device) -> bool:
    """Whether a norm should write its output's e4m3 copy for an FP8 consumer of T tokens: on CUDA
    with cuBLAS's blockwise GEMM (the path that takes it), T past the weight-streaming bound."""
    return torch.device(device).type == "cuda" and T > FP8_STREAM_MAX_T and _use_cublas()


def _w8a8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, cfg: dict | None = None,
          xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    if x.is_cuda and _use_cublas():
        # scale_a [M, K/128] M-major and scale_b [K/128, N/128] K-major: the (1x128, 128x128) recipe;
        # cuBLASLt takes M-major scales only with M a multiple of 4 (65, 66: NOT_SUPPORTED, and torch
        # refuses a padded stride): rows of zeros pad the step, their outputs dropped
        pad = act_rows(M) - M
        if xq is not None:  # a norm's e4m3 copy of x (`act_buffers`): act_quant's bits
            xq, xs = xq
            assert xq.shape == (M + pad, K) and xs.shape == (triton.cdiv(K, BLOCK), M + pad), (xq.shape, M)
        else:
            xq, xs = act_quant(torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x)
        y = torch._scaled_mm(xq, w.t(), scale_a=xs.t(), scale_b=s.t(), out_dtype=x.dtype)
        return y[:M] if pad else y
    xq, xs = act_quant(x)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    cfg = cfg or gemm_config(M, N)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _w8a8_kernel[grid](xq, xs, w, s, y, M, N, K, s.stride(0), y.stride(0), UPCAST=interpreting(), **cfg,
                       **pdl.kw())
    return y


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ dequant(weight [N, K] e4m3, scale_inv)^T -> [..., N] in x's dtype.
    xq: x's e4m3 copy from the norm that wrote x (`act_buffers`), used where the cuBLAS W8A8 GEMM runs
    (else ignored: the same operands either way)."""
    N, K = weight.shape
    assert weight.dtype == torch.float8_e4m3fn and weight.is_contiguous(), (weight.dtype, weight.stride())
    assert scale_inv.dtype == torch.float32 and scale_inv.is_contiguous()
    assert tuple(scale_inv.shape) == (triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK)), scale_inv.shape
    assert x.shape[-1] == K and x.dtype in (torch.bfloat16, torch.float16, torch.float32), (x.shape, x.dtype)
    assert x.device == weight.device == scale_inv.device
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    if T > FP8_STREAM_MAX_T:
        return _w8a8(x2, weight, scale_inv, xq=xq).reshape(*lead, N)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)  # [T, N]
    if T == 1 and gemv.wanted(x2, weight, scale_inv):  # one token on the FP8 wgmma kernel
        gemv.project(x2, weight, scale_inv, y)
        return y.reshape(*lead, N)
    if T:
        stream_linear(x2, weight, scale_inv, y)
    return y.reshape(*lead, N)


def linear_conv_update(
    x: torch.Tensor,  # [T, K], the first B rows decoding
    weight: torch.Tensor,  # [N, K] e4m3 (with scale_inv) or x's dtype
    scale_inv: torch.Tensor | None,
    conv_weight: torch.Tensor,  # [C, k]
    conv_state: torch.Tensor,  # [S, k-1, C], updated in place at slots
    slots: torch.Tensor,  # [B] int64
    has_state: torch.Tensor,  # [B] bool
) -> torch.Tensor:
    """The DeltaNet in_proj with the decode conv: y = x W^T, then for the first B rows
    y[:, :C] <- silu(causal conv1d update of y[:, :C]) (`conv1d.causal_conv1d_update`). In the
    weight-streaming kernel's epilogue where it serves (FP8 up to FP8_STREAM_MAX_T tokens; BF16 where the
    H200 table has a config), else the projection, then the conv kernel in place. -> y [T, N]."""
    T, K = x.shape
    N = weight.shape[0]
    fp8 = scale_inv is not None
    if fp8 and T == 1 and gemv.wanted_conv(x, weight, scale_inv, conv_weight, conv_state, slots):
        y = torch.empty(T, N, dtype=x.dtype, device=x.device)
        gemv.project(x, weight, scale_inv, y, conv=(conv_weight, conv_state, slots, has_state))
        return y
    cfg = None
    max_t = FP8_STREAM_MAX_T if fp8 else SKINNY_MAX_T
    if x.is_cuda and 0 < T <= max_t and x.stride(1) == 1:
        cfg = stream_config(T, N, K, fp8, x.device)
    if cfg is None:
        y = fp8_linear(x, weight, scale_inv) if fp8 else dense_linear(x, weight)
        B, C = slots.shape[0], conv_weight.shape[0]
        if B:
            conv1d.causal_conv1d_update(y[:B, :C], conv_state, conv_weight, slots, has_state, out=y[:B, :C])
        return y
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    stream_linear(x, weight, scale_inv, y, cfg, conv=(conv_weight, conv_state, slots, has_state))
    return y
