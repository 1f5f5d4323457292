"""The decode step's glue, inside its CUDA graph (engine.cuda_graph.DecodeGraphs):

- `decode_inputs`: the packed per-row inputs made the model's in one launch: a row whose token is
  still pending (sampled by the previous, unfinished step) takes it from the token buffer on the
  device, and the lengths become int32.
- `argmax_rows`: the greedy token of each logits row (lowest index on ties, NaN above everything:
  torch.argmax's rule), in two launches: each program the max of a 2,048-column chunk, then one
  program a row over the chunks. It reads the lm_head's bf16 output, so a greedy step needs no
  fp32 copy of the logits.

References: `reference.decode_inputs`, `reference.argmax_rows` (tests/kernels/test_decode_io.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metainfer.kernels import pdl

CHUNK = 2048  # columns a program in the argmax's first pass (248,320: 122 programs a row)


@triton.jit
def _decode_inputs_kernel(packed, stride_p, tok_buf, ctx, seq, n, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr = 0):
    pdl.wait(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    ids = tl.load(packed + offs, mask=m, other=0)
    src = tl.load(packed + 6 * stride_p + offs, mask=m, other=-1)
    prev = tl.load(tok_buf + src, mask=m & (src >= 0), other=0)
    tl.store(packed + offs, tl.where(src >= 0, prev, ids), mask=m)
    tl.store(ctx + offs, tl.load(packed + 4 * stride_p + offs, mask=m, other=0).to(tl.int32), mask=m)
    tl.store(seq + offs, tl.load(packed + 5 * stride_p + offs, mask=m, other=0).to(tl.int32), mask=m)


def decode_inputs(packed: torch.Tensor, tok_buf: torch.Tensor, n: int, context_lens: torch.Tensor,
                  seq_lens: torch.Tensor) -> None:
    """packed [7, >= n] int64 rows: ids, positions, kv slot, state slot, context len, seq len,
    pending source (a row of tok_buf, or -1). In place: packed[0, i] = tok_buf[packed[6, i]] where
    that is >= 0; context_lens[:n], seq_lens[:n] (int32) = packed[4, :n], packed[5, :n]."""
    assert packed.shape[0] == 7 and packed.stride(1) == 1 and packed.dtype == torch.int64
    if n == 0:
        return
    block = min(triton.next_power_of_2(n), 1024)
    _decode_inputs_kernel[(triton.cdiv(n, block),)](packed, packed.stride(0), tok_buf, context_lens,
                                                     seq_lens, n, BLOCK=block, num_warps=4, **pdl.kw())


@triton.jit
def _argmax_chunks_kernel(x, stride_x, V, pv, pi, NCH, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    pdl.wait(USE_PDL)
    r = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + r.to(tl.int64) * stride_x + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    nan = v != v
    first_nan = tl.min(tl.where(nan, offs, V), axis=0)  # V: none
    mx, i = tl.max(tl.where(nan, -float("inf"), v), axis=0, return_indices=True,
                   return_indices_tie_break_left=True)
    has_nan = first_nan < V
    # a chunk with a NaN ranks above every chunk without one (+inf would tie with a real +inf)
    tl.store(pv + r * NCH + c, tl.where(has_nan, float("nan"), mx))
    tl.store(pi + r * NCH + c, tl.where(has_nan, first_nan, c * BLOCK + i))


@triton.jit
def _argmax_rows_kernel(pv, pi, NCH, out, NCH_P2: tl.constexpr, USE_PDL: tl.constexpr = 0):
    pdl.wait(USE_PDL)
    r = tl.program_id(0)
    offs = tl.arange(0, NCH_P2)
    v = tl.load(pv + r * NCH + offs, mask=offs < NCH, other=-float("inf"))
    nan = v != v
    first_nan = tl.min(tl.where(nan, offs, NCH), axis=0)
    _, j = tl.max(tl.where(nan, -float("inf"), v), axis=0, return_indices=True,
                  return_indices_tie_break_left=True)
    j = tl.where(first_nan < NCH, first_nan, j)  # chunks in column order: the lowest index wins a tie
    tl.store(out + r, tl.load(pi + r * NCH + j).to(tl.int64))


def argmax_rows(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[r] (int64) = argmax of x[r] (x [R, V] bf16 / fp16 / fp32, rows contiguous); -> out."""
    R, V = x.shape
    assert x.stride(1) == 1 and out.shape[0] >= R and out.dtype == torch.int64
    if R == 0:
        return out
    nch = triton.cdiv(V, CHUNK)
    pv = torch.empty(R, nch, dtype=torch.float32, device=x.device)
    pi = torch.empty(R, nch, dtype=torch.int32, device=x.device)
    _argmax_chunks_kernel[(R, nch)](x, x.stride(0), V, pv, pi, nch, BLOCK=CHUNK, num_warps=4, **pdl.kw())
    _argmax_rows_kernel[(R,)](pv, pi, nch, out, NCH_P2=max(triton.next_power_of_2(nch), 16), num_warps=1,
                              **pdl.kw())
    return out
