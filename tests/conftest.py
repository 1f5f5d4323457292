"""Test session setup: Triton kernels run in the interpreter on machines without CUDA, and torch runs
its CPU ops on one thread there."""

from __future__ import annotations

import os

import pytest

try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _one_cpu_thread():
    """Without CUDA: torch's ops on one thread. The tests' tensors are small, so a second OpenMP thread
    gains nothing, and on a machine whose cores are shared (CI, other jobs) every op then waits for a
    descheduled thread, and the engine tests run several times slower."""
    if _cuda:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
