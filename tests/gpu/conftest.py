"""GPU tests: where a gemv.cu wait gave up (its watchdog trapped the kernel, and the CUDA context is gone),
the test's report says which kernel, CTA and count (`gemv.watchdog_report`, read from pinned host memory)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _gemv_watchdog():
    yield
    from metainfer.kernels.cuda import gemv

    report = gemv.watchdog_report()
    if report is not None:
        print(report)  # shown under the failed test's captured output
        pytest.fail(report, pytrace=False)
