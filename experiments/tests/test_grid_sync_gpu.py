"""The grid barrier on the H200 (skipped without CUDA): a persistent GEMV chain over every SM, and
over fewer programs than row blocks, equals one launch per stage bit for bit with no barrier give-up;
the same in a CUDA graph replayed three times (the counter is re-zeroed inside the graph)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: grid_sync.py

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _case(S, N, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(S, N, N, device="cuda", generator=g) / N**0.5).to(torch.bfloat16)
    x = torch.randn(N, device="cuda", generator=g)
    return w, x


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("S, N, programs", [(8, 2048, None), (5, 2000, 7), (40, 256, None), (3, 4096, 1)])
def test_persistent_chain_equals_launches(S, N, programs, prefetch):
    import grid_sync as gs

    w, x = _case(S, N)
    a = gs.chain_by_launches(w, gs.chain_buffer(w, x))
    counter, err = (torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2))
    b = gs.chain_persistent(w, gs.chain_buffer(w, x), counter, err, programs=programs, prefetch=prefetch)
    torch.cuda.synchronize()
    progs = programs or torch.cuda.get_device_properties(0).multi_processor_count
    assert int(err) == 0 and int(counter) == (S - 1) * progs
    assert torch.isfinite(b).all() and torch.equal(a, b)


def test_persistent_chain_in_a_cuda_graph():
    import grid_sync as gs

    w, x = _case(12, 1024, seed=1)
    want = gs.chain_by_launches(w, gs.chain_buffer(w, x))
    y = gs.chain_buffer(w, x)
    counter, err = (torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2))
    gs.chain_persistent(w, y, counter, err)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gs.chain_persistent(w, y, counter, err)
    for _ in range(3):
        y[1:] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
        assert int(err) == 0 and torch.equal(y, want)
