"""experiments/stream_chain.cu (KB-0074's persistent-kernel skeleton) compiles for sm_90a, where this
machine has nvcc: a CPU-only check that the GPU phase `chain2` of experiments/gpu_mega.sh will build."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "experiments" / "stream_chain.cu"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_stream_chain_compiles_for_sm90a(tmp_path):
    res = subprocess.run(
        ["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-o", str(tmp_path / "sc"),
         str(SRC)], capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warning" not in res.stderr.lower(), res.stderr[-3000:]
