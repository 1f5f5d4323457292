"""benchmarks/ab_inproc.py (the in-process A/B of decode-kernel settings) on the CPU with a tiny dummy model:
the modes' parsing into typed settings, each mode's settings in force around its run and the process's own
after, and every run's figures and greedy fingerprint (the CPU path has no graphs to capture: the recapture
is a no-op there, the GPU's is exercised on the H200)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from metainfer import settings
from tests.helpers import write_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ab_inproc  # noqa: E402


def test_parse_mode():
    assert ab_inproc.parse_mode("default") == {}
    assert ab_inproc.parse_mode("pdl=0") == {"pdl": False}
    both = {"pdl": True, "fp8_tuned": Path("x/y.json")}
    assert ab_inproc.parse_mode("METAINFER_PDL=1,fp8_tuned=x/y.json") == both
    for bad in ("pdl", "=1", "pdl=0,", "1A=2", "nope=1", "pdl=maybe", "cache_dir=/x", "METAINFER_API_KEY=k"):
        with pytest.raises(ValueError):  # (the last two: read at start-up only)
            ab_inproc.parse_mode(bad)


def test_round_order_alternates():
    assert [ab_inproc.round_order(3, r) for r in range(3)] == [[0, 1, 2], [2, 1, 0], [0, 1, 2]]


def test_switches_hold_one_mode_at_a_time():
    start = settings.settings()
    sw = ab_inproc.Switches()
    sw.apply({"pdl": not start.pdl})
    assert settings.settings().pdl is not start.pdl
    sw.apply({"fp8_tuned": Path("t.json")})  # the previous mode's settings are gone
    assert settings.settings().pdl is start.pdl and settings.settings().fp8_tuned == Path("t.json")
    sw.restore()
    assert settings.settings() == start


def test_runs_on_the_cpu(tmp_path, monkeypatch):
    cfg = write_config(tmp_path)
    captures = []
    from metainfer.engine.runner import ModelRunner

    orig = ModelRunner.recapture_decode

    def spy(self):
        captures.append(dict(pdl=settings.settings().pdl))
        orig(self)

    monkeypatch.setattr(ModelRunner, "recapture_decode", spy)
    res = ab_inproc.main(["--config", str(cfg), "--device", "cpu", "--dtype", "bfloat16", "--rounds", "2",
                          "--modes", "default", "pdl=0", "--prompt-len", "12", "--gen", "8",
                          "--out", str(tmp_path / "out")])
    # a discarded warm-up run, then each run captured under its own mode, odd rounds reversed
    on = settings.settings().pdl
    assert [c["pdl"] for c in captures] == [on, on, False, False, on]
    assert settings.settings().pdl is on  # the process's own again
    assert [(r["mode"], r["round"]) for r in res["runs"]] == [
        ("default", 0), ("pdl=0", 0), ("pdl=0", 1), ("default", 1)]
    for r in res["runs"]:
        assert r["decode_tok_s"] > 0 and r["steps"] >= 4 and not r["errors"]
    # the setting does nothing here: the same greedy tokens within a round, new prompts each round
    by = {(r["mode"], r["round"]): r["tokens_sha1"] for r in res["runs"]}
    assert by[("default", 0)] == by[("pdl=0", 0)] and by[("default", 0)] != by[("default", 1)]
    summary = {s["mode"]: s for s in res["summary"]}
    assert summary["pdl=0"]["tokens_as_first_mode"] and summary["default"]["runs"] == 2
    saved = json.loads((tmp_path / "out" / "ab_inproc_bfloat16.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(res["summary"]))


def test_a_failed_run_is_recorded_and_the_rest_measured(tmp_path, monkeypatch):
    """A mode whose run fails (decode_run's RuntimeError, not CUDA's) is listed as failed; the other modes'
    runs go on, and the JSON holds what was measured."""
    cfg = write_config(tmp_path)
    real = ab_inproc.decode_run

    def flaky(llm, batch, prompt_len, gen, seed):
        if settings.settings().fp8_tuned is not None:
            raise RuntimeError("no decode step of 1 sequences timed (errors: ['boom'])")
        return real(llm, batch, prompt_len, gen, seed)

    monkeypatch.setattr(ab_inproc, "decode_run", flaky)
    res = ab_inproc.main(["--config", str(cfg), "--device", "cpu", "--dtype", "bfloat16", "--rounds", "2",
                          "--modes", "default", "fp8_tuned=/nonexistent.json", "--prompt-len", "12",
                          "--gen", "6",
                          "--out", str(tmp_path / "out")])
    assert [r["mode"] for r in res["runs"]] == ["default", "default"]
    bad = "fp8_tuned=/nonexistent.json"
    assert [(f["mode"], f["round"]) for f in res["failed"]] == [(bad, 0), (bad, 1)]
    saved = json.loads((tmp_path / "out" / "ab_inproc_bfloat16.json").read_text())
    assert [s["mode"] for s in saved["summary"]] == ["default"] and len(saved["failed"]) == 2
