"""Single-token causal depthwise conv1d + SiLU for the DeltaNet decode path, with the rolling conv
state of each sequence's slot updated in place."""

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
