"""The grid barrier and the GEMV chain (experiments/grid_sync.py) on the interpreter: one
persistent program (the only valid grid there) against one launch per stage, bit for bit, and
against torch's fp32 chain (rel. RMSE < 1e-5); odd sizes (N = 80, a partial row block; K blocks
of 32 over 80 columns). Real grids, where the barrier matters, run on the H200 (test_grid_sync_gpu.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import rel_rmse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: grid_sync.py
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("S, N, block_n, block_k", [(3, 64, 16, 64), (4, 80, 16, 32), (1, 48, 32, 32)])
def test_chain_persistent_equals_launches_and_torch(S, N, block_n, block_k, prefetch):
    import grid_sync as gs

    g = torch.Generator().manual_seed(S * N)
    w = (torch.randn(S, N, N, generator=g) / N**0.5).to(torch.bfloat16)
    x = torch.randn(N, generator=g)
    a = gs.chain_by_launches(w, gs.chain_buffer(w, x), block_n, block_k)
    counter, err = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    b = gs.chain_persistent(w, gs.chain_buffer(w, x), counter, err, block_n=block_n, block_k=block_k,
                            prefetch=prefetch)
    assert int(err) == 0 and int(counter) == S - 1  # one arrival per barrier, none after the last stage
    assert torch.isfinite(b).all() and torch.equal(a, b)
    want = [x]
    for s in range(S):
        want.append(w[s].float() @ want[-1])
    assert rel_rmse(b, torch.stack(want)) < 1e-5
