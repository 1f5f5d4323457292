"""benchmarks/ab_inproc.py (the in-process A/B of decode-kernel switches) on the CPU with a tiny dummy model:
the modes' parsing, the environment set and restored around each run, gemv.cu reloaded only where a load-time
switch moved, and every run's figures and greedy fingerprint (the CPU path has no graphs to capture: the
recapture is a no-op there, the GPU's is exercised on the H200)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from metainfer.kernels.cuda import gemv
from tests.helpers import write_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ab_inproc  # noqa: E402


def test_parse_mode():
    assert ab_inproc.parse_mode("default") == {}
    assert ab_inproc.parse_mode("A=1,B=x/y") == {"A": "1", "B": "x/y"}
    assert ab_inproc.parse_mode("A=") == {"A": ""}
    for bad in ("A", "=1", "A=1,", "1A=2", "METAINFER_FP8_LM_HEAD=1", "METAINFER_PDL_PREFILL=1"):
        with pytest.raises(ValueError):  # (the last two: read at load / by prefill only)
            ab_inproc.parse_mode(bad)


def test_round_order_alternates():
    assert [ab_inproc.round_order(3, r) for r in range(3)] == [[0, 1, 2], [2, 1, 0], [0, 1, 2]]


def test_switches_restore_and_report_reloads(monkeypatch):
    monkeypatch.setenv("MI_TEST_A", "start")
    monkeypatch.delenv("MI_TEST_B", raising=False)
    monkeypatch.delenv(gemv.SLOTS_ENV, raising=False)
    modes = [{}, {"MI_TEST_A": "1"}, {"MI_TEST_B": "2", gemv.SLOTS_ENV: "6"}]
    sw = ab_inproc.Switches(modes)
    import os

    assert sw.apply(modes[1]) is False and os.environ["MI_TEST_A"] == "1" and "MI_TEST_B" not in os.environ
    assert sw.apply(modes[2]) is True  # the experts' ring: gemv.cu must be reloaded
    assert os.environ["MI_TEST_A"] == "start" and os.environ["MI_TEST_B"] == "2"
    assert sw.apply(modes[0]) is True  # and back
    assert os.environ["MI_TEST_A"] == "start" and "MI_TEST_B" not in os.environ
    assert gemv.SLOTS_ENV not in os.environ


def test_runs_on_the_cpu(tmp_path, monkeypatch):
    cfg = write_config(tmp_path)
    monkeypatch.delenv("MI_TEST_MODE", raising=False)
    captures = []
    from metainfer.engine.runner import ModelRunner

    orig = ModelRunner.recapture_decode

    def spy(self):
        captures.append(dict(mode=__import__("os").environ.get("MI_TEST_MODE")))
        orig(self)

    monkeypatch.setattr(ModelRunner, "recapture_decode", spy)
    res = ab_inproc.main(["--config", str(cfg), "--device", "cpu", "--dtype", "bfloat16", "--rounds", "2",
                          "--modes", "default", "MI_TEST_MODE=1", "--prompt-len", "12", "--gen", "8",
                          "--out", str(tmp_path / "out")])
    # a discarded warm-up run, then each run captured under its own mode, odd rounds reversed
    assert [c["mode"] for c in captures] == [None, None, "1", "1", None]
    assert "MI_TEST_MODE" not in __import__("os").environ
    assert [(r["mode"], r["round"]) for r in res["runs"]] == [
        ("default", 0), ("MI_TEST_MODE=1", 0), ("MI_TEST_MODE=1", 1), ("default", 1)]
    for r in res["runs"]:
        assert r["decode_tok_s"] > 0 and r["steps"] >= 4 and not r["errors"]
    # the switch does nothing here: the same greedy tokens within a round, new prompts each round
    by = {(r["mode"], r["round"]): r["tokens_sha1"] for r in res["runs"]}
    assert by[("default", 0)] == by[("MI_TEST_MODE=1", 0)] and by[("default", 0)] != by[("default", 1)]
    summary = {s["mode"]: s for s in res["summary"]}
    assert summary["MI_TEST_MODE=1"]["tokens_as_first_mode"] and summary["default"]["runs"] == 2
    saved = json.loads((tmp_path / "out" / "ab_inproc_bfloat16.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(res["summary"]))


def test_a_failed_run_is_recorded_and_the_rest_measured(tmp_path, monkeypatch):
    """A mode whose run fails (decode_run's RuntimeError, not CUDA's) is listed as failed; the other modes'
    runs go on, and the JSON holds what was measured."""
    cfg = write_config(tmp_path)
    real = ab_inproc.decode_run

    def flaky(llm, batch, prompt_len, gen, seed):
        if __import__("os").environ.get("MI_TEST_BAD") == "1":
            raise RuntimeError("no decode step of 1 sequences timed (errors: ['boom'])")
        return real(llm, batch, prompt_len, gen, seed)

    monkeypatch.setattr(ab_inproc, "decode_run", flaky)
    res = ab_inproc.main(["--config", str(cfg), "--device", "cpu", "--dtype", "bfloat16", "--rounds", "2",
                          "--modes", "default", "MI_TEST_BAD=1", "--prompt-len", "12", "--gen", "6",
                          "--out", str(tmp_path / "out")])
    assert [r["mode"] for r in res["runs"]] == ["default", "default"]
    assert [(f["mode"], f["round"]) for f in res["failed"]] == [("MI_TEST_BAD=1", 0), ("MI_TEST_BAD=1", 1)]
    saved = json.loads((tmp_path / "out" / "ab_inproc_bfloat16.json").read_text())
    assert [s["mode"] for s in saved["summary"]] == ["default"] and len(saved["failed"]) == 2
