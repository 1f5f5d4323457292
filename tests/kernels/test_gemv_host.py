"""cuda/gemv.py's host side on the CPU: the watchdog's report (the kernels themselves run in
tests/gpu/test_gemv_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from metainfer.kernels.cuda import gemv


def test_watchdog_report_names_the_wait(monkeypatch):
    """gemv.cu's watchdog writes [code, CTA, thread, chunk, parity] into pinned host memory before it traps;
    watchdog_report turns that into a line."""
    monkeypatch.setattr(gemv, "_KERNELS", {})
    assert gemv.watchdog_report() is None
    watch = torch.zeros(8, dtype=torch.int32)
    monkeypatch.setattr(gemv, "_KERNELS", {torch.device("cuda", 0): SimpleNamespace(watch=watch), "x": None})
    assert gemv.watchdog_report() is None  # nothing recorded
    watch[:5] = torch.tensor([2, 3, 128, 5, 1], dtype=torch.int32)
    report = gemv.watchdog_report()
    assert "CTA 3" in report and "thread 128" in report
    assert "a full ring slot" in report and "chunk 5" in report
    watch[0] = 3
    assert "an empty ring slot" in gemv.watchdog_report()
