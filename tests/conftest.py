"""Test session setup: Triton kernels run in the interpreter on machines without CUDA, and torch runs
its CPU ops on one thread there."""

from __future__ import annotations

import gc
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


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux
        return 0


@pytest.fixture(scope="session", autouse=True)
def _small_cpu_kv_cache():
    """Without CUDA: engines left to size their own KV cache take 128 MB of it, not the CPU default's
    gigabyte, which every engine would zero page by page (the tests' models are tiny: 128 MB holds
    thousands of blocks, far more than any test fills; the oracle and tests that need a size set it)."""
    if _cuda:
        yield
        return
    from metainfer.engine import runner

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "CPU_CACHE_BYTES", 128 << 20)
        yield


@pytest.fixture(autouse=True)
def _free_dead_engines():
    """After a test whose process holds over 2 GB: a garbage collection. A test's engines often sit in
    reference cycles (a proposer or hook closing over its LLM), and a cycle is only freed by a
    collection, which the few Python objects an engine allocates rarely set off, while each engine
    holds a CPU KV cache of up to a gigabyte: without it the suite's memory grew engine by engine."""
    yield
    if _rss_bytes() > 2 << 30:
        gc.collect()
