"""The loop's machinery on a toy repository (a sleep-bound "engine", an oracle and a bench as scripts, a
2-round A/B): the judge's verdicts and exit codes, its KB records, the ratchet, `loop run` with a scripted
agent, its report and its resumption after a kill, and `loop tune` with a fake kernel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metainfer.cli import main
from metainfer.kb.records import load_all
from metainfer.loop import gitops
from metainfer.loop.judge import Judge
from metainfer.loop.run import LoopRun
from metainfer.loop.tune import tune
from tests.loop.loop_helpers import commit, edit, git, make_toy_repo, write_plan

FIX = {"edits": [edit("DELAY = 0.04", "DELAY = 0.01")], "message": "toy: shorter sleep"}
WRONG = {"edits": [edit("return 2 * x", "return 2 * x + (x == 1)")], "message": "toy: wrong for 1"}
TAMPER_ORACLE = {
    "edits": [edit("compute(i) == 2 * i", "True", "judge/oracle.py")],
    "message": "relax the oracle",
}
TAMPER_TEST = {"edits": [edit("== 4", "is not None", "tests/test_toy.py")], "message": "relax a test"}
NEUTRAL = {"edits": [edit("def compute(x):", "def compute(x):  # doubles x")], "message": "toy: a comment"}
CRASH = {"crash": True}


@pytest.fixture()
def toy(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    repo, cfg = make_toy_repo(tmp_path)
    return repo, cfg, tmp_path


def _records(tmp: Path) -> list:
    return load_all(tmp / "kb") if (tmp / "kb").exists() else []


def _judge_cli(repo: Path, base: str, cand: str, *extra: str) -> int:
    return main(["loop", "judge", "--repo", str(repo), "--base", base, "--candidate", cand, *extra])


def test_judge_verdicts_records_and_ratchet(toy, capsys):
    repo, cfg, tmp = toy
    base = git(repo, "rev-parse", "HEAD")

    def propose(step: dict) -> str:
        git(repo, "checkout", "-q", "--detach", base)
        for e in step["edits"]:
            p = repo / e["file"]
            p.write_text(p.read_text().replace(e["old"], e["new"], 1))
        return commit(repo, step["message"])

    fix, wrong, t_oracle, t_test, neutral = (
        propose(s) for s in (FIX, WRONG, TAMPER_ORACLE, TAMPER_TEST, NEUTRAL)
    )
    git(repo, "checkout", "-q", base)
    t_import = propose(
        {
            "edits": [edit("import time\n", "import time\nimport judge.oracle\nimport transformers\n")],
            "message": "peek",
        }
    )
    t_toml = propose({"edits": [edit("min_gain = 0.1", "min_gain = 0.0", "loop.toml")], "message": "loosen"})
    broken = propose({"edits": [edit("return 2 * x", "return 2 * x + 1")], "message": "toy: off by one"})
    # right where the oracle looks (0..2), failing where only the bench goes (3)
    bench_fail = propose(
        {
            "edits": [edit("    time.sleep(DELAY)\n", "    time.sleep(DELAY)\n    assert x < 3\n")],
            "message": "toy: x < 3",
        }
    )
    git(repo, "checkout", "-q", base)

    assert _judge_cli(repo, base, fix) == 0
    out = capsys.readouterr().out
    assert "verdict: ACCEPTED (accepted)" in out and "| calls_s |" in out and "ratchet:" in out
    assert gitops.rev(repo, "loop/ratchet") == fix
    expect = {
        wrong: "oracle",
        broken: "tests",
        bench_fail: "bench",
        t_oracle: "tamper",
        t_test: "tamper",
        t_import: "tamper",
        t_toml: "tamper",
        neutral: "noise",
        base: "empty",
    }
    for cand, category in expect.items():
        assert _judge_cli(repo, base, cand) == 1, category
        assert f"REJECTED ({category})" in capsys.readouterr().out
    assert gitops.rev(repo, "loop/ratchet") == fix  # rejected ones never move it
    assert _judge_cli(repo, base, "no-such-rev") == 2

    recs = {r.tags[2].removeprefix("commit:"): r for r in _records(tmp)}
    assert len(recs) == 9  # every verdict but the empty diff's
    ok = recs[fix]
    assert ok.status == "kept" and ok.oracle["passed"] is True and (repo / ok.oracle["verdict"]).is_file()
    assert ok.before["commit"] == base and ok.after["commit"] == fix and len(ok.after["diff_sha256"]) == 64
    assert ok.after["calls_s"] > 2 * ok.before["calls_s"] and len(ok.after["calls_s_runs"]) == 2
    assert ok.target.gpu == "cpu" and "judge/bench.py" in ok.benchmark and ok.files == ("toy/engine.py",)
    bad = recs[wrong]
    assert bad.status == "reverted" and bad.oracle["passed"] is False and "double.1" in bad.oracle["note"]
    assert recs[t_oracle].oracle["passed"] is None and "judge/oracle.py" in recs[t_oracle].lesson
    assert "transformers" in recs[t_import].lesson or "judge" in recs[t_import].lesson
    assert "loop.toml" in recs[t_toml].lesson
    assert recs[neutral].status == "reverted" and "(noise)" in recs[neutral].lesson


def test_candidate_cannot_change_the_judge_even_unchecked(toy):
    """With the tamper check's patterns emptied, the candidate's tree still runs the base's oracle."""
    repo, cfg, tmp = toy
    base = git(repo, "rev-parse", "HEAD")
    (repo / "toy/engine.py").write_text((repo / "toy/engine.py").read_text().replace("2 * x", "3 * x"))
    (repo / "judge/oracle.py").write_text(
        (repo / "judge/oracle.py").read_text().replace("== 2 * i", "== 3 * i")
    )
    cand = commit(repo, "wrong, with an oracle to match")
    judge = Judge(repo, cfg, tmp / "work", log=lambda m: None)
    import metainfer.loop.judge as jm

    orig = jm.tamper.check_paths
    jm.tamper.check_paths = lambda files, pats: []
    try:
        v = judge.judge(base, cand)
    finally:
        jm.tamper.check_paths = orig
    assert v.category in ("tests", "oracle") and not v.accepted


def test_run_with_a_scripted_agent(toy):
    repo, cfg, tmp = toy
    start = git(repo, "rev-parse", "HEAD")
    dirty = {**NEUTRAL, "commit": False, "message": "uncommitted"}
    agent = write_plan(tmp / "plan.json", [FIX, WRONG, TAMPER_TEST, CRASH, dirty])
    rc = main(
        [
            "loop",
            "run",
            "--repo",
            str(repo),
            "--agent",
            agent,
            "--iterations",
            "5",
            "--run-dir",
            str(tmp / "run"),
        ]
    )
    assert rc == 0
    state = json.loads((tmp / "run/state.json").read_text())
    got = [(it["status"], it["category"]) for it in state["iterations"]]
    assert got == [
        ("accepted", "accepted"),
        ("rejected", "oracle"),
        ("rejected", "tamper"),
        ("agent_failed", "agent"),
        ("rejected", "noise"),
    ]
    fix = state["iterations"][0]["candidate"]
    assert gitops.rev(repo, "loop/ratchet") == fix and gitops.is_ancestor(repo, start, fix)
    assert all(it["base"] == fix for it in state["iterations"][1:])
    assert (
        "exit 3" in state["iterations"][3]["reason"]
        and "crashing on purpose" in state["iterations"][3]["reason"]
    )
    assert state["iterations"][4]["candidate"]  # the loop committed the agent's uncommitted change
    assert state["stopped"].startswith("iteration budget")
    # the head passed the oracle as a candidate: a failing candidate does not make it run on the head again
    steps = json.loads((tmp / "run/iter-002/judge/verdict.json").read_text())["steps"]
    assert "oracle" in steps and "oracle.base" not in steps
    assert state["figures"]["calls_s"] > 50
    assert len(_records(tmp)) == 4  # the crash made no candidate, so no record
    brief = (tmp / "run/iter-002/brief.md").read_text()
    assert "calls_s" in brief and "iteration 1: accepted" in brief and "tests/**" in brief
    assert "`judge/bench.py`" in brief  # a file the judge runs is protected too
    assert "roofline omitted (a toy)" in brief  # the bench's own word on its roofline share
    report = (tmp / "run/report.md").read_text()
    assert report.count("\n| ") == 6 and "![goal metrics](report.png)" in report
    assert (tmp / "run/report.png").stat().st_size > 1000
    # rejected candidates stay reachable for inspection; the worktree is gone
    assert gitops.exists(repo, f"refs/loop/{state['id']}/2") and not (tmp / "run/worktree").exists()


def test_run_resumes_without_losing_or_repeating_a_verdict(toy, monkeypatch):
    repo, cfg, tmp = toy
    agent = write_plan(tmp / "plan.json", [FIX, NEUTRAL, WRONG])
    root = tmp / "run"
    calls = []
    real = Judge.judge

    def judge_then_die(self, base, cand):
        calls.append(cand)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while judging iteration 2
        return real(self, base, cand)

    monkeypatch.setattr(Judge, "judge", judge_then_die)
    first = LoopRun(repo, cfg, agent, root, log=lambda m: None)
    with pytest.raises(ValueError, match="another metainfer loop run"):
        LoopRun(repo, cfg, agent, root, log=lambda m: None)
    with pytest.raises(KeyboardInterrupt):
        first.run()
    state = json.loads((root / "state.json").read_text())
    assert len(state["iterations"]) == 1 and state["pending"]["n"] == 2
    # restarted: iteration 2's candidate is judged (once), iteration 1 is not judged again
    import dataclasses

    run = LoopRun(repo, dataclasses.replace(cfg, iterations=3), agent, root, log=lambda m: None)
    run.run()
    state = json.loads((root / "state.json").read_text())
    assert [it["n"] for it in state["iterations"]] == [1, 2, 3]
    assert calls[1:] == [
        state["iterations"][1]["candidate"],
        state["iterations"][1]["candidate"],
        state["iterations"][2]["candidate"],
    ]
    assert len(_records(tmp)) == 3

    # killed after the verdict was saved but before the state knew: adopted, not judged again
    it3 = state["iterations"].pop()
    verdict = root / "iter-003/judge/verdict.json"
    v = json.loads(verdict.read_text())
    Path(v["record"]).unlink()
    v["record"] = None
    verdict.write_text(json.dumps(v))
    state["pending"] = it3
    (root / "state.json").write_text(json.dumps(state))
    monkeypatch.setattr(Judge, "judge", lambda *a: pytest.fail("judged again"))
    LoopRun(repo, cfg, agent, root, log=lambda m: None)._finish_pending()
    state = json.loads((root / "state.json").read_text())
    assert [it["n"] for it in state["iterations"]] == [1, 2, 3] and state["pending"] is None
    assert len(_records(tmp)) == 3


def test_a_base_the_oracle_fails_is_no_verdict(toy, capsys):
    repo, cfg, tmp = toy
    (repo / "toy/engine.py").write_text(
        (repo / "toy/engine.py").read_text().replace("2 * x", "2 * x + (x == 1)")
    )
    base = commit(repo, "toy: wrong for 1, untested")
    (repo / "toy/engine.py").write_text(
        (repo / "toy/engine.py").read_text().replace("DELAY = 0.04", "DELAY = 0.01")
    )
    cand = commit(repo, "toy: faster")
    assert _judge_cli(repo, base, cand) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the oracle fails on the base") and "double.1" in err[-1]
    assert _records(tmp) == [] and not gitops.exists(repo, "loop/ratchet")


class FakeKernel:
    """The toy's "kernel": its sleep per call, tuned from a table; one config is fast but wrong."""

    name, tolerance = "toy_sleep", 1e-3

    def table(self, gpu: str) -> str:
        return "toy/tuned_cpu.json"

    def keys(self) -> list[str]:
        return ["compute"]

    def default(self, key: str) -> dict:
        return {"delay": 0.04}

    def candidates(self, key: str) -> list[dict]:
        return [{"delay": 0.02}, {"delay": 0.01}, {"delay": 0.0, "wrong": True}, {"delay": -1}]

    def measure(self, key: str, config: dict) -> tuple[float, float]:
        if config["delay"] < 0:
            raise RuntimeError("out of resources")
        return 1e6 * config["delay"] + 1.0, 1.0 if config.get("wrong") else 0.0


def test_tune_sweeps_checks_writes_and_judges(toy):
    repo, cfg, tmp = toy
    base = git(repo, "rev-parse", "HEAD")
    r = tune(repo, cfg, FakeKernel(), "cpu", tmp / "tune", log=lambda m: None)
    assert r.winners == {"compute": {"config": {"delay": 0.01}, "us": 10001.0, "default_us": 40001.0}}
    assert sum(t.ok for t in r.trials) == 3 and any("out of resources" in t.note for t in r.trials)
    table = json.loads(git(repo, "show", f"{r.commit}:toy/tuned_cpu.json"))
    assert table["gpu"] == "cpu" and table["configs"] == {"compute": {"delay": 0.01}}
    assert r.verdict.accepted, r.verdict.reason
    assert gitops.rev(repo, "loop/ratchet") == r.commit and git(repo, "rev-parse", "HEAD") == base
    assert _records(tmp)[0].status == "kept" and _records(tmp)[0].files == ("toy/tuned_cpu.json",)


def test_report_without_matplotlib(toy, monkeypatch):
    import sys

    from metainfer.loop import report

    repo, cfg, tmp = toy
    it = {
        "n": 1,
        "status": "rejected",
        "candidate": "c" * 40,
        "reason": "x",
        "record": None,
        "figures": {"calls_s": {"base_median": 25.0, "candidate_median": 25.5, "change": 0.02, "band": 0.1}},
    }
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    path = report.write(tmp, cfg, {"iterations": [it], "start": "a" * 40})
    text = path.read_text()
    assert "no plot: matplotlib is not installed" in text and "25 -> 25.5 (+2.0%, band 10.0%)" in text
    assert not (tmp / "report.png").exists()
