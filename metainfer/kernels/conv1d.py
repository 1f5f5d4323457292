"""Causal depthwise conv1d + SiLU for the DeltaNet: the single-token decode step and the varlen
prefill over whole sequences, each continuing from its slot's rolling conv state (the last K-1
inputs), which it updates in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metainfer.kernels import pdl

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# channels per program and warps; tuned on H200 by benchmarks/kernels_a.py
BLOCK_C = 512
NUM_WARPS = 4


@triton.jit
def _conv_update_kernel(
    x_ptr, state_ptr, w_ptr, out_ptr, slots_ptr, has_ptr,
    C, sx0, so0, s_slot, s_k,
    K: tl.constexpr, Y_DT: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl.wait(USE_PDL)
    # x: [B, C] rows strided by sx0; state: [S, K-1, C] strides (s_slot, s_k, 1); w: [C, K];
    # out: [B, C] rows strided by so0 (may be x itself: each element is read before it is written)
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    n_prev = C * tl.load(has_ptr + b).to(tl.int32)  # C when the slot holds state, else 0
    x = tl.load(x_ptr + b.to(tl.int64) * sx0 + cols, mask=cmask, other=0.0)
    s_base = state_ptr + slot * s_slot + cols
    w_base = w_ptr + cols * K
    acc = x.to(tl.float32) * tl.load(w_base + (K - 1), mask=cmask, other=0.0).to(tl.float32)
    # window = [state[0], ..., state[K-2], x]; the new state is window[1:]
    for j in tl.static_range(K - 1):
        prev = tl.load(s_base + j * s_k, mask=cols < n_prev, other=0.0).to(x.dtype)
        acc += prev.to(tl.float32) * tl.load(w_base + j, mask=cmask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(s_base + (j - 1) * s_k, prev.to(state_ptr.dtype.element_ty), mask=cmask)
    tl.store(s_base + (K - 2) * s_k, x.to(state_ptr.dtype.element_ty), mask=cmask)
    y = acc.to(Y_DT).to(tl.float32)
    y = y * tl.sigmoid(y)
    tl.store(out_ptr + b.to(tl.int64) * so0 + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)


def causal_conv1d_update(
    x: torch.Tensor,  # [B, C] one new input per sequence (rows may be strided)
    conv_state: torch.Tensor,  # [S, K-1, C] updated in place at `slots`
    weight: torch.Tensor,  # [C, K]
    slots: torch.Tensor,  # [B] int64
    has_state: torch.Tensor,  # [B] bool; False: previous inputs are zeros
    out: torch.Tensor | None = None,  # [B, C] in x's dtype, rows may be strided; may be x (in place)
) -> torch.Tensor:
    """silu(depthwise causal conv of [state, x]) -> [B, C] in x's dtype; state <- last K-1 inputs."""
    assert x.dim() == 2 and x.stride(1) == 1, "x: [B, C] with contiguous channels"
    B, C = x.shape
    assert weight.dim() == 2 and weight.shape[0] == C and weight.is_contiguous(), weight.shape
    K = weight.shape[1]
    assert K >= 2
    assert conv_state.dim() == 3 and conv_state.shape[1:] == (K - 1, C), (conv_state.shape, K, C)
    assert conv_state.stride(2) == 1, "conv_state channels must be contiguous"
    assert slots.shape == (B,) and slots.dtype == torch.int64, (slots.shape, slots.dtype)
    assert has_state.shape == (B,) and has_state.dtype == torch.bool, (has_state.shape, has_state.dtype)
    assert x.dtype in _TL_DTYPE and weight.dtype in _TL_DTYPE and conv_state.dtype in _TL_DTYPE
    if out is None:
        out = torch.empty(B, C, dtype=x.dtype, device=x.device)
    assert out.shape == (B, C) and out.dtype == x.dtype and out.stride(1) == 1, (out.shape, out.dtype)
    if B == 0:
        return out
    _conv_update_kernel[(B, triton.cdiv(C, BLOCK_C))](
        x, conv_state, weight, out, slots, has_state.view(torch.uint8),
        C, x.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1),
        K=K, Y_DT=_TL_DTYPE[weight.dtype], BLOCK_C=BLOCK_C, num_warps=NUM_WARPS, **pdl.kw(),
    )
    return out


# ---- prefill: whole sequences, varlen ------------------------------------------------------------
PREFILL_BLOCK_T = 32
PREFILL_BLOCK_C = 128


@triton.jit
def _conv_prefill_kernel(
    x_ptr, state_ptr, w_ptr, out_ptr, cu_ptr, slots_ptr, has_ptr,
    C, sx0, so0, s_slot, s_k,
    K: tl.constexpr, KP: tl.constexpr, Y_DT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """Program (sequence n, token block, channel block): out[t] = silu(sum_j w[:, j] x[t - (K-1) + j])
    for the block's tokens of sequence n (rows cu[n]:cu[n+1] of x), inputs before the sequence
    taken from its slot's state (zeros without state). Token block 0 also writes the new state
    (the last K-1 inputs of [state, x]) after reading the old one; no other block reads the state
    (BLOCK_T >= K-1), so nothing races."""
    pdl.wait(USE_PDL)
    n = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    start = tl.load(cu_ptr + n).to(tl.int64)
    L = tl.load(cu_ptr + n + 1).to(tl.int64) - start
    if t0 < L:
        cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        slot = tl.load(slots_ptr + n).to(tl.int64)
        n_prev = C * tl.load(has_ptr + n).to(tl.int32)  # C when the slot holds state, else 0
        s_base = state_ptr + slot * s_slot
        rows = t0 + tl.arange(0, BLOCK_T)  # positions in the sequence
        live = rows < L
        acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
        for j in tl.static_range(K):
            pos = rows - (K - 1) + j
            xv = tl.load(x_ptr + (start + pos)[:, None] * sx0 + cols[None, :],
                         mask=(live & (pos >= 0))[:, None] & cmask[None, :], other=0.0)
            sv = tl.load(s_base + (K - 1 + pos)[:, None] * s_k + cols[None, :],
                         mask=(live & (pos < 0))[:, None] & (cols < n_prev)[None, :], other=0.0)
            v = tl.where((pos >= 0)[:, None], xv.to(tl.float32), sv.to(xv.dtype).to(tl.float32))
            acc += v * tl.load(w_ptr + cols * K + j, mask=cmask, other=0.0).to(tl.float32)[None, :]
        y = acc.to(Y_DT).to(tl.float32)
        y = y * tl.sigmoid(y)
        tl.store(out_ptr + (start + rows)[:, None] * so0 + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & cmask[None, :])
        if t0 == 0:  # new state row i = input at position L - (K-1) + i, from x or the old state
            i = tl.arange(0, KP)
            p = L - (K - 1) + i
            ok = (i < K - 1)[:, None] & cmask[None, :]
            x_in = tl.load(x_ptr + (start + p)[:, None] * sx0 + cols[None, :], mask=ok & (p >= 0)[:, None],
                           other=0.0)
            s_in = tl.load(s_base + (K - 1 + p)[:, None] * s_k + cols[None, :],
                           mask=ok & (p < 0)[:, None] & (cols < n_prev)[None, :], other=0.0)
            new = tl.where((p >= 0)[:, None], x_in.to(state_ptr.dtype.element_ty),
                           s_in.to(x_in.dtype).to(state_ptr.dtype.element_ty))
            tl.debug_barrier()  # every old-state read of this program is done before the writes
            tl.store(s_base + i[:, None] * s_k + cols[None, :], new, mask=ok)


def causal_conv1d(
    x: torch.Tensor,  # [T, C] this step's prefill inputs, sequences concatenated (rows may be strided)
    conv_state: torch.Tensor,  # [S, K-1, C] updated in place at the slots
    weight: torch.Tensor,  # [C, K]
    query_start_loc: list[int],  # [B+1] host offsets (the reference path)
    slots: list[int],  # [B]
    has_state: list[bool],  # [B]
    cu: torch.Tensor | None = None,  # [B+1] int32 device offsets (the kernel)
    slots_dev: torch.Tensor | None = None,  # [B] int64
    has_dev: torch.Tensor | None = None,  # [B] bool
    max_len: int | None = None,  # >= every sequence's length (sizes the grid); None: from the host offsets
) -> torch.Tensor:
    """`reference.causal_conv1d` (silu of each sequence's causal depthwise conv, continuing from its
    state; states <- the last K-1 inputs) in one launch from the device offsets, where
    they are given; else the reference. -> [T, C] in x's dtype."""
    from metainfer.kernels import reference as ref

    B = len(slots)
    if cu is None or B == 0:
        return ref.causal_conv1d(x, conv_state, weight, query_start_loc, slots, has_state)
    T, C = x.shape
    K = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and weight.shape[0] == C and K >= 2
    assert conv_state.shape[1:] == (K - 1, C) and conv_state.stride(2) == 1, conv_state.shape
    assert cu.shape == (B + 1,) and slots_dev.shape == (B,) and has_dev.shape == (B,)
    assert slots_dev.dtype == torch.int64 and has_dev.dtype == torch.bool
    assert PREFILL_BLOCK_T >= K - 1
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if max_len is None:
        max_len = max(b - a for a, b in zip(query_start_loc, query_start_loc[1:]))
    grid = (B, triton.cdiv(max_len, PREFILL_BLOCK_T), triton.cdiv(C, PREFILL_BLOCK_C))
    _conv_prefill_kernel[grid](
        x, conv_state, weight, out, cu, slots_dev, has_dev.view(torch.uint8),
        C, x.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1),
        K=K, KP=triton.next_power_of_2(K - 1), Y_DT=_TL_DTYPE[weight.dtype], BLOCK_T=PREFILL_BLOCK_T,
        BLOCK_C=PREFILL_BLOCK_C, num_warps=4, **pdl.kw(),
    )
    return out
