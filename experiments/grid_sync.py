"""A grid-wide barrier for persistent kernels, and a chain of GEMVs to measure it against kernel
boundaries (KB-0034: is a barrier inside one launch cheaper than a launch boundary in a CUDA graph?).

`grid_barrier` is the cooperative-groups grid sync written in Triton: every program syncs its
threads, adds 1 to a global counter (release, GPU scope), and polls it (acquire) until it reaches
`target` = (barrier index + 1) x programs; the caller zeroes the counter before each launch. All
programs must be resident at once (grid <= SM count x programs per SM), or it never returns; the
poll gives up after `max_spins` and reports it, so a broken barrier fails a test instead of hanging.
On the interpreter (one program at a time) only a grid of 1 is valid.

The chain: y[s + 1] = W[s] @ y[s] with y[0] = x, W [S, N, N], y [S + 1, N] fp32 (rows 1.. start
as NaN, so a stage that reads before its input is written shows), fp32 accumulation in the same
order per row, so the two forms below agree bit for bit:
- `chain_by_launches`: one launch per stage (`_gemv_stage_kernel`, a program per BLOCK_N rows);
- `chain_persistent`: one launch for all stages (`_gemv_chain_kernel`, programs take row blocks
  round-robin, a barrier between stages).
experiments/barrier_bench.py times both on the H200. (Moved out of the package, metainfer/kernels/grid_sync.py
until b4eb65f, with the megakernel it was a step towards: only this experiment uses it.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metainfer.kernels import pdl
from metainfer.kernels.common import interpreting, num_sms


@triton.jit
def grid_barrier(counter_ptr, target, max_spins):
    """Waits until every program has arrived (see the module doc). -> 1 if it gave up, else 0."""
    tl.debug_barrier()  # this program's threads have issued their stores
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < max_spins):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    tl.debug_barrier()
    return (seen < target).to(tl.int32)


@triton.jit
def _w_tile(w_ptr, rb, k0, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    return tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _gemv_rows(w_ptr, x_ptr, y_ptr, rb, N, w_first, use_first, K: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """y[rb*BLOCK_N : +BLOCK_N] = w[rows] @ x, fp32, the K blocks in order; use_first: the first
    K block is `w_first` (loaded earlier), not loaded here."""
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if use_first & (k0 == 0):
            w = w_first
        else:
            w = _w_tile(w_ptr, rb, k0, N, K, BLOCK_N, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + rows, acc, mask=rows < N)


@triton.jit
def _gemv_stage_kernel(w_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_PDL: tl.constexpr = 0):
    """One stage: y_ptr + N = w @ y_ptr."""
    pdl.wait(USE_PDL)
    none = tl.zeros((BLOCK_N, BLOCK_K), dtype=w_ptr.dtype.element_ty)
    pid = tl.program_id(0)
    _gemv_rows(w_ptr, y_ptr, y_ptr + N, pid, N, none, pid < 0, K, BLOCK_N, BLOCK_K)


@triton.jit
def _gemv_chain_kernel(w_ptr, y_ptr, counter_ptr, err_ptr, N, max_spins, K: tl.constexpr,
                       STAGES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PREFETCH: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """All stages, a barrier between them. PREFETCH: before each barrier a program loads the first
    weight tile of its first row block of the next stage (weights do not depend on the stage's
    input), so that load's latency hides behind the wait."""
    pdl.wait(USE_PDL)
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    blocks = tl.cdiv(N, BLOCK_N)
    w_next = tl.zeros((BLOCK_N, BLOCK_K), dtype=w_ptr.dtype.element_ty)
    for s in range(STAGES):
        for rb in range(pid, blocks, progs):
            if PREFETCH:
                use_first = (s > 0) & (rb == pid)
            else:
                use_first = rb < 0
            _gemv_rows(w_ptr + s * N * K, y_ptr + s * N, y_ptr + (s + 1) * N, rb, N, w_next, use_first, K,
                       BLOCK_N, BLOCK_K)
        if s + 1 < STAGES:
            if PREFETCH:
                w_next = _w_tile(w_ptr + (s + 1) * N * K, pid, 0, N, K, BLOCK_N, BLOCK_K)
            gave_up = grid_barrier(counter_ptr, (s + 1) * progs, max_spins)
            if gave_up != 0:
                tl.atomic_add(err_ptr, 1)


def _check(w: torch.Tensor, x: torch.Tensor) -> tuple[int, int, int]:
    S, N, K = w.shape
    assert N == K and x.shape == (K,) and x.dtype == torch.float32 and w.is_contiguous(), (w.shape, x.shape)
    return S, N, K


def chain_buffer(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y [S + 1, N] fp32: row 0 = x, the stages' rows NaN."""
    S, N, _ = _check(w, x)
    y = torch.full((S + 1, N), float("nan"), device=x.device)
    y[0] = x
    return y


def chain_by_launches(w: torch.Tensor, y: torch.Tensor, block_n: int = 16, block_k: int = 128):
    """Fills y[1:] (see `chain_buffer`), one launch per stage. -> y."""
    S, N, K = _check(w, y[0])
    for s in range(S):
        _gemv_stage_kernel[(triton.cdiv(N, block_n),)](
            w[s], y[s], N, K=K, BLOCK_N=block_n, BLOCK_K=block_k, **pdl.kw()
        )
    return y


def chain_persistent(w: torch.Tensor, y: torch.Tensor, counter: torch.Tensor, err: torch.Tensor,
                     programs: int | None = None, block_n: int = 16, block_k: int = 128,
                     max_spins: int = 1 << 22, prefetch: bool = False) -> torch.Tensor:
    """Fills y[1:] in one launch; counter, err: int32 [1], zeroed here (a CUDA graph of this call
    replays correctly); err counts barrier give-ups (0 when sound). programs: default the SM count
    (1 on the interpreter). -> y."""
    S, N, K = _check(w, y[0])
    if programs is None:
        programs = 1 if interpreting() else num_sms(y.device)
    assert programs >= 1 and (programs == 1 or not interpreting()), "the interpreter runs one program"
    counter.zero_()
    err.zero_()
    _gemv_chain_kernel[(programs,)](w, y, counter, err, N, max_spins, K=K, STAGES=S, BLOCK_N=block_n,
                                    BLOCK_K=block_k, PREFETCH=prefetch, **pdl.kw())
    return y
