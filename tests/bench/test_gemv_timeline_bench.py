"""benchmarks/gemv_timeline.py's host side on the CPU: the timeline build's flag added to (or taken out of)
each mode's gemv.cu flags, and the launches' names (the run itself needs the H200)."""

from __future__ import annotations

import sys
from pathlib import Path

from metainfer.kernels.mega import gemv
from metainfer.kernels.mega import gemv_timeline as T

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gemv_timeline as bench  # noqa: E402


def test_with_timeline_adds_the_flag_once(monkeypatch):
    monkeypatch.setenv(gemv.DEFINES_ENV, "-DGEMV_EARLY=1")
    on = bench.with_timeline({"A": "1"}, True)
    assert on == {"A": "1", gemv.DEFINES_ENV: f"-DGEMV_EARLY=1 {T.DEFINE}"}
    assert bench.with_timeline(on, True) == on  # not twice
    assert bench.with_timeline(on, False) == {"A": "1", gemv.DEFINES_ENV: "-DGEMV_EARLY=1"}
    mode = {gemv.DEFINES_ENV: "-DGEMV_PRE_EARLY=1"}  # a mode's own flags replace the process's
    assert bench.with_timeline(mode, True)[gemv.DEFINES_ENV] == f"-DGEMV_PRE_EARLY=1 {T.DEFINE}"


def _launch(kind: str, n_rows: int) -> T.Launch:
    return T.Launch(seq=0, kind=kind, n_rows=n_rows, grid=132, t0_us=0.0, events={"end": [1.0]}, waits={})


def test_labels_name_the_gate_up_by_its_layer():
    qkv, inp = _launch("gemv_e4m3_pre", 9216), _launch("gemv_e4m3_pre", 12352)
    moe = _launch("moe_gate_up_e4m3", 9216)
    assert bench.label(qkv, moe) == "attention qkv" and bench.label(inp, moe) == "DeltaNet in_proj"
    assert bench.label(moe, qkv) == "experts' gate/up (attention layer)"
    assert bench.label(moe, inp) == "experts' gate/up (DeltaNet layer)"
    assert bench.label(_launch("gemv_e4m3", 12352), None) == "layer 0's in_proj"
    assert bench.label(_launch("gemv_e4m3", 4096), None) == "gemv_e4m3 4096 rows"
