"""Repositories for the loop's tests: a toy one (a sleep-bound "engine", an oracle and a bench as scripts:
the loop's machinery in seconds) and a copy of this repository with a slowed decode step (the real
engine, oracle and bench)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import textwrap
from io import BytesIO
from pathlib import Path

from metainfer.loop.config import parse

ROOT = Path(__file__).resolve().parents[2]
AGENT = Path(__file__).with_name("scripted_agent.py")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@test.invalid", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def commit(repo: Path, msg: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", msg)
    return git(repo, "rev-parse", "HEAD")


def write_plan(path: Path, steps: list[dict]) -> str:
    """The plan file and the agent command that plays it."""
    path.write_text(json.dumps(steps))
    return f"{sys.executable} {AGENT} {path}"


# ---- the toy repository ---------------------------------------------------------------------------------
TOY_ENGINE = """\
import json
import time
from pathlib import Path

DELAY = 0.04
_TABLE = Path(__file__).with_name("tuned_cpu.json")  # what the tests' fake kernel tuner writes
if _TABLE.exists():
    DELAY = json.loads(_TABLE.read_text())["configs"]["compute"]["delay"]


def compute(x):
    time.sleep(DELAY)
    return 2 * x
"""
TOY_ORACLE = """\
import json
import sys

from toy.engine import compute

checks = [{"name": f"double.{i}", "passed": compute(i) == 2 * i} for i in range(3)]
failed = [c["name"] for c in checks if not c["passed"]]
json.dump({"passed": not failed, "checks": checks, "failed": failed}, open(sys.argv[1], "w"))
sys.exit(1 if failed else 0)
"""
TOY_BENCH = """\
import json
import sys
import time

from toy.engine import compute

t = time.perf_counter()
for i in range(4):
    compute(i)
dt = (time.perf_counter() - t) / 4
json.dump({"metrics": {"calls_s": 1 / dt, "call_ms": 1000 * dt}, "roofline": {"omitted": "a toy"}},
          open(sys.argv[1], "w"))
"""
TOY_TEST = """\
from toy.engine import compute


def test_double():
    assert compute(2) == 4
"""


def toy_config(kb_dir: Path, rounds: int = 2, **over) -> dict:
    py = "{python}"
    cfg = {
        "boundary": {"target": "qwen", "model": "a toy", "dtype": "float32", "device": "cpu", "gpu": "cpu"},
        "goal": {
            "primary": "calls_s",
            "min_gain": 0.10,
            "metrics": [
                {
                    "name": "calls_s",
                    "workload": "toy",
                    "key": "metrics.calls_s",
                    "better": "higher",
                    "target": 1e9,
                },
                {
                    "name": "call_ms",
                    "workload": "toy",
                    "key": "metrics.call_ms",
                    "better": "lower",
                    "tolerance": 0.5,
                },
            ],
        },
        "oracle": {"command": [py, "judge/oracle.py", "{out}"], "timeout_minutes": 1},
        # the tests without pytest's start-up (plugins: seconds), as a one-line runner
        "tests": {"command": [py, "-c", "from tests.test_toy import test_double; test_double()"]},
        "bench": {
            "rounds": rounds,
            "workloads": [{"name": "toy", "command": [py, "judge/bench.py", "{out}"]}],
        },
        "budget": {"iterations": 10},
        "paths": {"kb_dir": str(kb_dir)},
    }
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return cfg


def toml_text(cfg: dict) -> str:
    from metainfer.loop.template import render

    full = {
        k: cfg.get(k, {})
        for k in ("boundary", "goal", "oracle", "tests", "bench", "judge", "agent", "budget", "paths")
    }
    return render(full)


def make_toy_repo(tmp: Path, rounds: int = 2) -> tuple[Path, object]:
    """(repo, LoopConfig): a git repository whose one commit holds the toy and its loop.toml."""
    repo = tmp / "toy"
    for rel, text in {
        "toy/__init__.py": "",
        "toy/engine.py": TOY_ENGINE,
        "judge/oracle.py": TOY_ORACLE,
        "judge/bench.py": TOY_BENCH,
        "tests/test_toy.py": TOY_TEST,
    }.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    raw = toy_config(tmp / "kb", rounds)
    (repo / "loop.toml").write_text(toml_text(raw))
    git(repo.parent, "init", "-q", "-b", "main", str(repo))
    commit(repo, "toy engine")
    return repo, parse(raw, "toy")


def edit(old: str, new: str, file: str = "toy/engine.py") -> dict:
    return {"file": file, "old": old, "new": new}


# ---- a copy of this repository with a slowed decode step ---------------------------------------------------
SLOW_ANCHOR = "        batch = self.scheduler.schedule()\n"
SLOWDOWN = "        time.sleep(0.03)  # planted: the loop's tests remove it again\n"


def make_engine_repo(tmp: Path, rev: str = "HEAD") -> tuple[Path, str]:
    """(repo, the slowed commit): this repository's committed package, pyproject and the few tests the
    judge runs, in a fresh git repository of two commits: as committed, then a sleep in every engine step."""
    repo = tmp / "engine"
    repo.mkdir()
    paths = [
        "metainfer",
        "pyproject.toml",
        "tests/__init__.py",
        "tests/conftest.py",
        "tests/helpers.py",
        "tests/test_settings.py",
    ]
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, *paths], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(repo, filter="data")
    git(tmp, "init", "-q", "-b", "main", str(repo))
    commit(repo, "upstream")
    eng = repo / "metainfer/engine/engine.py"
    text = eng.read_text()
    assert SLOW_ANCHOR in text and "import time" in text, "the engine's step changed: update SLOW_ANCHOR"
    eng.write_text(text.replace(SLOW_ANCHOR, SLOW_ANCHOR + SLOWDOWN, 1))
    return repo, commit(repo, "engine: a sleep in every step")


def engine_config(kb_dir: Path, rounds: int = 2) -> dict:
    """The CPU defaults of `metainfer loop init`, made short: the quick oracle, a 2-round A/B of a short
    decode, tests/test_settings.py as the CPU tests."""
    from metainfer.loop.template import defaults

    cfg = defaults("qwen", "cpu", None, None, None)
    cfg["tests"]["command"] = [
        "{python}",
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:hypothesispytest",
        "tests/test_settings.py",
    ]
    cfg["bench"]["rounds"] = rounds
    w = cfg["bench"]["workloads"][0]["command"]
    w[w.index("--num-iters") + 1] = "3"  # the process's median: one lucky run is not its figure
    w[w.index("--output-len") + 1] = "16"
    cfg["goal"]["min_gain"] = 0.08
    cfg["goal"]["metrics"][0]["target"] = 1e6  # never met: the budget ends the runs
    cfg["goal"]["metrics"][1]["tolerance"] = 1.0  # a 16-token prefill's time is noise on a shared CPU
    cfg["paths"]["kb_dir"] = str(kb_dir)
    return cfg


def dedent(s: str) -> str:
    return textwrap.dedent(s)
