"""`loop.toml`: the boundary, the goal metrics, the judge's commands and the budgets of `metainfer loop`.

Read with `tomllib` into frozen dataclasses (`load`); written as text by `template.render` (`loop init`).
Commands are argument lists whose items may hold the placeholders {python} (this interpreter), {out}
(the JSON file the command writes), {model}, {dtype} and {device} (the boundary's).
"""

from __future__ import annotations

import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TARGETS = ("qwen", "sam")
# the judge, its thresholds and the tests; the models and configs of the boundary (a smaller model is faster)
DEFAULT_PROTECTED = (
    "metainfer/assets/**",
    "metainfer/configs/**",
    "metainfer/oracle/**",
    "metainfer/bench/**",
    "metainfer/loop/**",
    "metainfer/kb/**",
    "metainfer/cli.py",
    "benchmarks/ab_inproc.py",
    "tests/**",
    "loop.toml",
    "pyproject.toml",
    "conftest.py",
    "pytest.ini",
    "setup.cfg",
    "tox.ini",
    # what Python or git run before the engine: startup hooks, path files, archive attributes
    "sitecustomize.py",
    "usercustomize.py",
    "*.pth",
    ".gitattributes",
)


class ConfigError(ValueError):
    """loop.toml is missing, malformed or inconsistent; the message names the field."""


@dataclass(frozen=True)
class Boundary:
    target: str = "qwen"  # qwen | sam
    model: str = ""  # "" = the embedded default model; an HF dir; dummy:CONFIG
    dtype: str = "float32"
    device: str = "cpu"  # cpu | cuda
    gpu: str = "cpu"  # "cpu", or a substring of the GPU's name the figures hold for ("H200")
    traffic: str = "decode"  # the KB records' target.traffic


@dataclass(frozen=True)
class Metric:
    name: str
    workload: str  # a bench workload's name
    key: str  # dotted path of the figure in that workload's JSON ("metrics.decode_tok_s")
    better: str = "higher"  # higher | lower
    target: float | None = None  # the goal: a run stops once every metric with a target reaches it
    tolerance: float = 0.05  # a relative worsening beyond this rejects a candidate


@dataclass(frozen=True)
class Workload:
    name: str
    command: tuple[str, ...]
    timeout_minutes: float = 10.0


@dataclass(frozen=True)
class Step:
    """A judge step that passes or fails on its exit code (the oracle: and on its JSON's `passed`)."""

    command: tuple[str, ...]
    timeout_minutes: float = 30.0


@dataclass(frozen=True)
class LoopConfig:
    boundary: Boundary
    primary: str  # the metric a candidate must improve
    min_gain: float  # the smallest relative gain accepted, whatever the measured noise band
    metrics: tuple[Metric, ...]
    oracle: Step
    tests: Step | None
    workloads: tuple[Workload, ...]
    rounds: int  # A/B rounds: base and candidate once each, order alternating
    protected: tuple[str, ...]  # path patterns a candidate may not touch (DEFAULT_PROTECTED + loop.toml's)
    forbidden: tuple[str, ...]  # extra regexes that added lines may not match (judge/tamper.py has the rest)
    agent_command: str
    agent_timeout_minutes: float
    profile_command: tuple[str, ...]  # its output's tail goes into the brief (empty: none)
    iterations: int
    wall_minutes: float
    device_minutes: float
    kb_dir: str  # "" = the repository's metainfer/kb/records
    run_dir: str  # relative to the repository root unless absolute
    ratchet: str  # branch name
    source: str = ""  # the file it was read from
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def metric(self, name: str) -> Metric:
        return next(m for m in self.metrics if m.name == name)

    def __post_init__(self) -> None:
        b = self.boundary
        if b.target not in TARGETS:
            raise ConfigError(f"boundary.target must be one of {', '.join(TARGETS)}, got {b.target!r}")
        names = [m.name for m in self.metrics]
        if not names:
            raise ConfigError("goal.metrics: at least one metric")
        if len(set(names)) != len(names):
            raise ConfigError("goal.metrics: duplicate names")
        if self.primary not in names:
            raise ConfigError(
                f"goal.primary {self.primary!r} is not one of goal.metrics ({', '.join(names)})"
            )
        loads = {w.name for w in self.workloads}
        if len(loads) != len(self.workloads):
            raise ConfigError("bench.workloads: duplicate names")
        for m in self.metrics:
            if m.workload not in loads:
                raise ConfigError(f"metric {m.name}: workload {m.workload!r} is not in bench.workloads")
            if m.better not in ("higher", "lower"):
                raise ConfigError(f"metric {m.name}: better must be higher or lower")
            if m.tolerance < 0:
                raise ConfigError(f"metric {m.name}: tolerance must be >= 0")
        if self.rounds < 1:
            raise ConfigError("bench.rounds must be >= 1")
        if self.min_gain < 0:
            raise ConfigError("goal.min_gain must be >= 0")
        for w in (*self.workloads, self.oracle):
            if not w.command:
                raise ConfigError("every command must be a non-empty list of strings")
        if not any("{out}" in a for a in self.oracle.command):
            raise ConfigError("oracle.command must write its JSON verdict to {out}")
        for w in self.workloads:
            if not any("{out}" in a for a in w.command):
                raise ConfigError(f"workload {w.name}: its command must write its JSON to {{out}}")
        if min(self.iterations, self.wall_minutes, self.device_minutes) <= 0:
            raise ConfigError("budget: iterations, wall_minutes and device_minutes must be positive")

    def fill(self, command: tuple[str, ...], out: str = "") -> list[str]:
        """The command with its placeholders replaced."""
        b = self.boundary
        values = {
            "python": sys.executable,
            "out": out,
            "model": b.model,
            "dtype": b.dtype,
            "device": b.device,
        }
        return [a.format(**values) for a in command]


def _table(d: dict, name: str) -> dict:
    v = d.get(name, {})
    if not isinstance(v, dict):
        raise ConfigError(f"[{name}] must be a table")
    return v


def _cmd(v: Any, where: str) -> tuple[str, ...]:
    if v is None:
        raise ConfigError(f"{where} is missing")
    if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
        raise ConfigError(f"{where}: a command is a list of strings")
    return tuple(v)


def _num(d: dict, key: str, default: float, where: str) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"{where}.{key} must be a number")
    return float(v)


def _str(d: dict, key: str, default: str, where: str) -> str:
    v = d.get(key, default)
    if not isinstance(v, str):
        raise ConfigError(f"{where}.{key} must be a string")
    return v


def _known(d: dict, keys: set[str], where: str) -> None:
    extra = set(d) - keys
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(extra))}")


def parse(data: dict, source: str = "") -> LoopConfig:
    """A `LoopConfig` from loop.toml's parsed tables; raises ConfigError naming the bad field."""
    _known(
        data,
        {"boundary", "goal", "oracle", "tests", "bench", "judge", "agent", "budget", "paths"},
        "loop.toml",
    )
    bd = _table(data, "boundary")
    _known(bd, {"target", "model", "dtype", "device", "gpu", "traffic"}, "boundary")
    boundary = Boundary(**{k: _str(bd, k, getattr(Boundary(), k), "boundary") for k in bd})
    goal = _table(data, "goal")
    _known(goal, {"primary", "min_gain", "metrics"}, "goal")
    metrics = []
    for i, m in enumerate(goal.get("metrics", [])):
        where = f"goal.metrics[{i}]"
        if not isinstance(m, dict):
            raise ConfigError(f"{where} must be a table")
        _known(m, {"name", "workload", "key", "better", "target", "tolerance"}, where)
        for k in ("name", "workload", "key"):
            if not isinstance(m.get(k), str) or not m[k]:
                raise ConfigError(f"{where}.{k} must be a non-empty string")
        target = m.get("target")
        metrics.append(
            Metric(
                m["name"],
                m["workload"],
                m["key"],
                _str(m, "better", "higher", where),
                None if target is None else _num(m, "target", 0.0, where),
                _num(m, "tolerance", 0.05, where),
            )
        )
    oracle = _table(data, "oracle")
    _known(oracle, {"command", "timeout_minutes"}, "oracle")
    tests = _table(data, "tests")
    _known(tests, {"command", "timeout_minutes"}, "tests")
    bench = _table(data, "bench")
    _known(bench, {"rounds", "workloads"}, "bench")
    workloads = []
    for i, w in enumerate(bench.get("workloads", [])):
        where = f"bench.workloads[{i}]"
        if not isinstance(w, dict):
            raise ConfigError(f"{where} must be a table")
        _known(w, {"name", "command", "timeout_minutes"}, where)
        workloads.append(
            Workload(
                _str(w, "name", "", where),
                _cmd(w.get("command"), f"{where}.command"),
                _num(w, "timeout_minutes", 10.0, where),
            )
        )
    judge = _table(data, "judge")
    _known(judge, {"protected", "forbidden"}, "judge")
    agent = _table(data, "agent")
    _known(agent, {"command", "timeout_minutes", "profile_command"}, "agent")
    budget = _table(data, "budget")
    _known(budget, {"iterations", "wall_minutes", "device_minutes"}, "budget")
    paths = _table(data, "paths")
    _known(paths, {"kb_dir", "run_dir", "ratchet"}, "paths")
    extra_protected = _cmd(judge.get("protected", []), "judge.protected")
    rounds = _num(bench, "rounds", 3, "bench")
    iterations = _num(budget, "iterations", 20, "budget")
    if rounds != int(rounds) or iterations != int(iterations):
        raise ConfigError("bench.rounds and budget.iterations must be integers")
    return LoopConfig(
        boundary=boundary,
        primary=_str(goal, "primary", metrics[0].name if metrics else "", "goal"),
        min_gain=_num(goal, "min_gain", 0.03, "goal"),
        metrics=tuple(metrics),
        oracle=Step(
            _cmd(oracle.get("command"), "oracle.command"), _num(oracle, "timeout_minutes", 30, "oracle")
        ),
        tests=(
            Step(_cmd(tests["command"], "tests.command"), _num(tests, "timeout_minutes", 10, "tests"))
            if tests.get("command")
            else None
        ),
        workloads=tuple(workloads),
        rounds=int(rounds),
        protected=tuple(dict.fromkeys(DEFAULT_PROTECTED + extra_protected)),
        forbidden=_cmd(judge.get("forbidden", []), "judge.forbidden"),
        agent_command=_str(agent, "command", "", "agent"),
        agent_timeout_minutes=_num(agent, "timeout_minutes", 60, "agent"),
        profile_command=_cmd(agent.get("profile_command", []), "agent.profile_command"),
        iterations=int(iterations),
        wall_minutes=_num(budget, "wall_minutes", 24 * 60, "budget"),
        device_minutes=_num(budget, "device_minutes", 8 * 60, "budget"),
        kb_dir=_str(paths, "kb_dir", "", "paths"),
        run_dir=_str(paths, "run_dir", ".loop", "paths"),
        ratchet=_str(paths, "ratchet", "loop/ratchet", "paths"),
        source=source,
        raw=data,
    )


def load(path: Path) -> LoopConfig:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (metainfer loop init writes one)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    return parse(data, str(path))
