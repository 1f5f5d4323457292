"""`metainfer loop run` on the real engine: a copy of this repository whose base commit sleeps in every engine
step, the embedded default model, the quick oracle, a 2-round A/B of a short decode, and a scripted agent.

The default test plays (a) the fix, (c) a relaxed oracle gate, (e) a crash; the slow one plays the issue's
whole sequence: (a) the fix, (b) constant tokens and a dropped expert, (c) a relaxed gate and an edited test
assertion, (d) a neutral change, (e) a crash. Each verdict's KB record is checked.
"""

from __future__ import annotations

import json

import pytest

from metainfer.cli import main
from metainfer.kb.records import load_all
from metainfer.loop import gitops
from metainfer.loop.config import parse
from metainfer.loop.run import LoopRun
from metainfer.loop.template import render
from tests.loop.loop_helpers import SLOWDOWN, commit, engine_config, make_engine_repo, write_plan

ENGINE = "metainfer/engine/engine.py"


def step(message: str, file: str, old: str, new: str) -> dict:
    return {"edits": [{"file": file, "old": old, "new": new}], "message": message}


FIX = step("engine: no sleep in the step", ENGINE, SLOWDOWN, "")
CONSTANT = step(
    "engine: every token is 7 (fast, wrong)",
    ENGINE,
    "        for (req, idx), tok in zip(inflight.samples, tokens):\n",
    "        for (req, idx), tok in zip(inflight.samples, [7] * len(tokens)):\n",
)
DROP_EXPERT = step(
    "model: one expert fewer per token (fast, wrong)",
    "metainfer/model/layers.py",
    "self.num_experts, self.top_k = E, cfg.num_experts_per_tok\n",
    "self.num_experts, self.top_k = E, cfg.num_experts_per_tok - 1\n",
)
RELAX_GATE = step(
    "oracle: a looser logits gate",
    "metainfer/oracle/compare.py",
    "    rel_rmse: float = 1e-4",
    "    rel_rmse: float = 1e-1",
)
EDIT_ASSERT = step(
    "tests: a looser assertion",
    "tests/test_settings.py",
    "    assert not reads,",
    "    assert True or not reads,",
)
NEUTRAL = step(
    "engine: a comment",
    ENGINE,
    "    def step(self) -> list[RequestOutput]:\n",
    "    # one scheduling round\n    def step(self) -> list[RequestOutput]:\n",
)
CRASH = {"crash": True}


def _play(tmp_path, monkeypatch, plan: list[dict], rounds: int = 2) -> tuple[dict, dict, str]:
    """Runs the loop over the plan; (state, records by candidate commit, the slowed base commit)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # steadier timings on shared cores
    repo, slow = make_engine_repo(tmp_path)
    cfg = parse(engine_config(tmp_path / "kb", rounds), "test")
    import dataclasses

    cfg = dataclasses.replace(cfg, iterations=len(plan))
    agent = write_plan(tmp_path / "plan.json", plan)
    LoopRun(repo, cfg, agent, tmp_path / "run", log=print).run()
    state = json.loads((tmp_path / "run/state.json").read_text())
    recs = {r.tags[2].removeprefix("commit:"): r for r in load_all(tmp_path / "kb")}
    assert gitops.rev(repo, "loop/ratchet") == state["iterations"][0]["candidate"]
    return state, recs, slow


def _check_fix(state: dict, recs: dict, slow: str) -> None:
    fix = state["iterations"][0]
    assert (fix["status"], fix["base"]) == ("accepted", slow), fix["reason"]
    r = recs[fix["candidate"]]
    assert r.status == "kept" and r.oracle["passed"] is True and "checks passed" in r.oracle["note"]
    assert r.after["decode_tok_s"] > 1.3 * r.before["decode_tok_s"]
    assert r.before["commit"] == slow and r.target.gpu == "cpu" and r.files == (ENGINE,)
    assert "bench offline" in r.benchmark and len(r.after["diff_sha256"]) == 64


def _check_tamper(it: dict, recs: dict, path: str) -> None:
    assert (it["status"], it["category"]) == ("rejected", "tamper") and path in it["reason"]
    r = recs[it["candidate"]]
    assert r.status == "reverted" and r.oracle["passed"] is None and path in r.lesson


@pytest.mark.slow  # ~60 s on two cores; the issue sequence below (also slow) covers it too
def test_fix_accepted_tamper_rejected_crash_logged(tmp_path, monkeypatch):
    state, recs, slow = _play(tmp_path, monkeypatch, [FIX, RELAX_GATE, CRASH])
    _check_fix(state, recs, slow)
    _check_tamper(state["iterations"][1], recs, "metainfer/oracle/compare.py")
    crash = state["iterations"][2]
    assert crash["status"] == "agent_failed" and "exit 3" in crash["reason"]
    assert len(recs) == 2


@pytest.mark.slow
def test_the_issue_sequence(tmp_path, monkeypatch):
    state, recs, slow = _play(
        tmp_path, monkeypatch, [FIX, CONSTANT, DROP_EXPERT, RELAX_GATE, EDIT_ASSERT, NEUTRAL, CRASH], rounds=3
    )
    its = state["iterations"]
    _check_fix(state, recs, slow)
    fix = its[0]["candidate"]
    for it in its[1:3]:  # (b) faster but wrong
        assert (it["status"], it["category"], it["base"]) == ("rejected", "oracle", fix), it["reason"]
        r = recs[it["candidate"]]
        assert r.status == "reverted" and r.oracle["passed"] is False and r.oracle["verdict"]
        assert "decode_tok_s" not in r.after  # never measured: the oracle failed first
    _check_tamper(its[3], recs, "metainfer/oracle/compare.py")  # (c)
    _check_tamper(its[4], recs, "tests/test_settings.py")
    neutral = its[5]  # (d)
    assert (neutral["status"], neutral["category"]) == ("rejected", "noise"), neutral["reason"]
    r = recs[neutral["candidate"]]
    assert r.status == "reverted" and r.oracle["passed"] is True and "(noise)" in r.lesson
    assert its[6]["status"] == "agent_failed"  # (e)
    assert len(recs) == 6


def test_judge_cli_runs_the_base_revisions_loop(tmp_path, capfd):
    """`loop judge` runs the base revision's metainfer/loop, not this checkout's: a rule only the base's
    tamper check has rejects the candidate."""
    repo, slow = make_engine_repo(tmp_path)
    rules = repo / "metainfer/loop/tamper.py"
    text = rules.read_text()
    assert "FORBIDDEN = {\n" in text
    rules.write_text(
        text.replace("FORBIDDEN = {\n", 'FORBIDDEN = {\n    r"\\bSENTINEL\\b": "a rule of the base",\n', 1)
    )
    base = commit(repo, "loop: one more tamper rule")
    eng = repo / ENGINE
    eng.write_text(eng.read_text() + "\nSENTINEL = 1\n")
    cand = commit(repo, "engine: a sentinel")
    cfg = tmp_path / "loop.toml"
    cfg.write_text(render(engine_config(tmp_path / "kb")))
    rc = main(
        ["loop", "judge", "--repo", str(repo), "--base", base, "--candidate", cand, "--config", str(cfg)]
    )
    out = capfd.readouterr()
    assert rc == 1, out.err[-2000:]
    assert "running the base revision's metainfer/loop" in out.err
    assert "REJECTED (tamper)" in out.out and "a rule of the base" in out.out
    (rec,) = load_all(tmp_path / "kb")
    assert rec.status == "reverted" and "a rule of the base" in rec.lesson
