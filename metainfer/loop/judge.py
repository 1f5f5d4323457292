"""`metainfer loop judge`: one candidate commit against its base, by a judge the candidate cannot change.

The judge's inputs come from the base revision only: its oracle, bench, tests and loop.toml are the
base's (`git archive`), and the candidate's tree is run with those files put back from the base. Order:
1. tamper check on the diff (metainfer/loop/tamper.py): reject before anything runs;
2. the candidate's CPU tests (loop.toml [tests]);
3. the oracle on the candidate's engine (the base's oracle): a fail rejects whatever the speed;
4. an A/B: every workload in a fresh process per side and round, the sides' order alternating;
5. the verdict rule (metainfer/loop/ab.py).
Each command runs with cwd and PYTHONPATH set to its side's tree (plain files, no .git).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from metainfer.loop import ab, gitops, tamper
from metainfer.loop.config import LoopConfig


class JudgeError(RuntimeError):
    """The judge cannot reach a verdict (a bad revision, the base's own benchmark failing, the wrong
    machine): no verdict and no record."""


@dataclass
class Verdict:
    accepted: bool
    category: str  # accepted | empty | tamper | tests | oracle | bench | noise | regression
    reason: str
    base: str
    candidate: str
    subject: str
    diff_sha256: str
    files: list[str]
    gpu: str
    figures: dict[str, dict] = field(default_factory=dict)  # metric -> ab.MetricAB.to_dict()
    oracle: dict[str, Any] = field(default_factory=lambda: {"passed": None, "verdict": None, "summary": ""})
    tests: dict[str, Any] = field(default_factory=lambda: {"passed": None, "log": None})
    findings: list[str] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)  # step -> the command line it ran
    roofline: dict[str, Any] = field(default_factory=dict)  # side -> workload -> its JSON's "roofline"
    steps: dict[str, dict] = field(default_factory=dict)  # command name -> {"rc", "seconds"}
    base_oracle: bool | None = None  # the oracle on the base, when it had to run there
    device_s: float = 0.0  # time spent in the judge's commands
    seconds: float = 0.0
    record: str | None = None  # the KB record's path, once written
    ratchet: str | None = None  # what happened to the ratchet branch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(**d)

    def save(self, path: Path) -> Path:
        """Written atomically: a reader sees the old file or the new one."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)
        return path


@dataclass
class Ran:
    rc: int
    seconds: float
    log: Path
    timed_out: bool = False


def run_command(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, timeout_s: float) -> Ran:
    """Runs cmd in its own process group, stdout+stderr into `log`. The group is killed whole when cmd
    ends (what it left running), on timeout, and when the caller is interrupted."""
    t0 = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        try:
            p = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as e:
            f.write(f"error: cannot start: {e}\n".encode())
            return Ran(127, time.perf_counter() - t0, log)
        try:
            rc = p.wait(timeout=timeout_s)
            return Ran(rc, time.perf_counter() - t0, log)
        except subprocess.TimeoutExpired:
            _kill_group(p)
            f.write(f"\nerror: killed after {timeout_s:.0f} s\n".encode())
            return Ran(-9, time.perf_counter() - t0, log, timed_out=True)
        finally:
            _kill_group(p)


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


def tail(path: Path, n: int = 6) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    lines = lines[1:] if lines and lines[0].startswith("$ ") else lines  # run_command's header
    return " | ".join(line.strip() for line in lines[-n:])[-600:]


def machine_gpu(cfg: LoopConfig) -> str:
    """The GPU's name ("cpu" when the boundary's device is the CPU); JudgeError when the machine is not
    the boundary's."""
    if not cfg.boundary.device.startswith("cuda"):
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise JudgeError(f"loop.toml's boundary is device {cfg.boundary.device} but this machine has no GPU")
    name = torch.cuda.get_device_name()
    if cfg.boundary.gpu.lower() not in ("", "cpu") and cfg.boundary.gpu.lower() not in name.lower():
        raise JudgeError(f"this machine's GPU is {name}; loop.toml's boundary.gpu is {cfg.boundary.gpu}")
    return name


def protected_patterns(repo: Path, cfg: LoopConfig, base: str) -> tuple[str, ...]:
    """loop.toml's protected patterns plus the files of `base` that the judge's commands name."""
    model = cfg.boundary.model.removeprefix("dummy:")  # a config or model dir in the repository: fixed too
    commands = [*_commands(cfg), [model]]
    return cfg.protected + tuple(tamper.command_files(commands, set(gitops.tree_files(repo, base))))


def _commands(cfg: LoopConfig) -> list[tuple[str, ...]]:
    return [cfg.oracle.command, *(w.command for w in cfg.workloads)] + (
        [cfg.tests.command] if cfg.tests else []
    )


class Judge:
    """base_oracle: whether the oracle is known to pass on the base (None: unknown). When the candidate fails
    it and the base's result is not known to be a pass, the oracle runs on the base too: a base that fails
    it is a JudgeError, not a rejection of the candidate."""

    def __init__(
        self,
        repo: Path,
        cfg: LoopConfig,
        work: Path,
        log: Callable[[str], None] = print,
        base_oracle: bool | None = None,
    ) -> None:
        self.repo, self.cfg, self.work, self.log = repo, cfg, work, log
        self.base_oracle = base_oracle
        self.device_s = 0.0

    # ---- the trees ------------------------------------------------------------------------------------
    def _env(self, tree: Path, sha: str) -> dict[str, str]:
        # PYTHONPATH: this side's tree and nothing else of ours; GIT_COMMIT: what result files record
        return {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", "GIT_COMMIT": sha}

    def _run(self, name: str, cmd: list[str], tree: Path, sha: str, timeout_min: float, v: Verdict) -> Ran:
        r = run_command(cmd, tree, self._env(tree, sha), self.work / "logs" / f"{name}.log", 60 * timeout_min)
        self.device_s += r.seconds
        v.steps[name] = {"rc": r.rc, "seconds": round(r.seconds, 2)}
        return r

    def _trees(self, base: str, cand: str, patterns: tuple[str, ...]) -> tuple[Path, Path]:
        trees = self.work / "trees"
        shutil.rmtree(trees, ignore_errors=True)
        b = gitops.extract(self.repo, base, trees / "base")
        c = gitops.extract(self.repo, cand, trees / "candidate")
        # the judge's files in the candidate's tree are the base's, whatever the diff said
        for p in sorted(c.rglob("*")):
            if p.is_file() and tamper.protected(p.relative_to(c).as_posix(), patterns):
                p.unlink()
        for p in sorted(b.rglob("*")):
            rel = p.relative_to(b).as_posix()
            if p.is_file() and tamper.protected(rel, patterns):
                (c / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, c / rel)
        return b, c

    # ---- the steps ----------------------------------------------------------------------------------
    def judge(self, base_rev: str, cand_rev: str) -> Verdict:
        t0 = time.perf_counter()
        cfg, repo = self.cfg, self.repo
        try:
            base, cand = gitops.rev(repo, base_rev), gitops.rev(repo, cand_rev)
        except gitops.GitError:
            raise JudgeError(
                f"not a commit: {base_rev if not gitops.exists(repo, base_rev) else cand_rev}"
            ) from None
        gpu = machine_gpu(cfg)
        self.work.mkdir(parents=True, exist_ok=True)
        files = gitops.changed_files(repo, base, cand)
        v = Verdict(
            False,
            "",
            "",
            base,
            cand,
            gitops.subject(repo, cand),
            gitops.diff_sha256(repo, base, cand),
            files,
            gpu,
        )
        self.log(f"judge: {base[:10]} -> {cand[:10]} ({len(files)} files) {v.subject!r}")

        def done(accepted: bool, category: str, reason: str) -> Verdict:
            v.accepted, v.category, v.reason = accepted, category, reason
            v.device_s, v.seconds = self.device_s, time.perf_counter() - t0
            shutil.rmtree(self.work / "trees", ignore_errors=True)
            self.log(f"judge: {'ACCEPTED' if accepted else 'REJECTED'} ({category}): {reason}")
            return v

        if not files:
            return done(False, "empty", "the candidate changes nothing")
        patterns = protected_patterns(repo, cfg, base)
        findings = tamper.check_paths(files, patterns)
        base_files = set(gitops.tree_files(repo, base))
        roots = ("", *tamper.script_dirs(_commands(cfg), base_files))
        findings += tamper.check_new_top_level(files, base_files, roots)
        findings += tamper.check_added_lines(gitops.diff_text(repo, base, cand), cfg.forbidden)
        if findings:
            v.findings = [str(f) for f in findings]
            return done(
                False,
                "tamper",
                f"tampering: {v.findings[0]}"
                + (f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""),
            )
        btree, ctree = self._trees(base, cand, patterns)

        if cfg.tests:
            cmd = cfg.fill(cfg.tests.command)
            v.commands["tests"] = " ".join(cmd)
            r = self._run("tests", cmd, ctree, cand, cfg.tests.timeout_minutes, v)
            v.tests = {"passed": r.rc == 0, "log": str(r.log)}
            if r.rc != 0:
                return done(False, "tests", f"the CPU tests failed (exit {r.rc}): {tail(r.log, 3)}")

        out = self.work / "oracle.json"
        out.unlink(missing_ok=True)
        cmd = cfg.fill(cfg.oracle.command, str(out))
        v.commands["oracle"] = " ".join(cmd)
        r = self._run("oracle", cmd, ctree, cand, cfg.oracle.timeout_minutes, v)
        passed, summary = _oracle_result(out, r)
        v.oracle = {"passed": passed, "verdict": str(out) if out.exists() else None, "summary": summary}
        if not passed and self.base_oracle is not True:
            bout = self.work / "oracle.base.json"
            bout.unlink(missing_ok=True)
            rb = self._run(
                "oracle.base",
                cfg.fill(cfg.oracle.command, str(bout)),
                btree,
                base,
                cfg.oracle.timeout_minutes,
                v,
            )
            v.base_oracle, bsummary = _oracle_result(bout, rb)
            if not v.base_oracle:
                shutil.rmtree(self.work / "trees", ignore_errors=True)
                raise JudgeError(
                    f"the oracle fails on the base {base[:10]} too ({bsummary}): no candidate can "
                    "be judged against it; fix the base first"
                )
        if not passed:
            return done(False, "oracle", f"the oracle failed: {summary}")

        try:
            figures = self._ab(btree, ctree, base, cand, v)
        except _CandidateBenchFailed as e:
            return done(False, "bench", str(e))
        results = [
            ab.compare(m, figures["base"][m.name], figures["candidate"][m.name], cfg.min_gain)
            for m in cfg.metrics
        ]
        v.figures = {r.name: r.to_dict() for r in results}
        d = ab.decide(results, cfg.primary)
        return done(d.accepted, d.category, d.reason)

    def _ab(
        self, btree: Path, ctree: Path, base: str, cand: str, v: Verdict
    ) -> dict[str, dict[str, list[float]]]:
        cfg = self.cfg
        figures: dict[str, dict[str, list[float]]] = {"base": {}, "candidate": {}}
        sides = {"base": (btree, base), "candidate": (ctree, cand)}
        for rnd in range(cfg.rounds):
            for side in ab.round_order(rnd):
                tree, sha = sides[side]
                for w in cfg.workloads:
                    out = self.work / "ab" / f"{w.name}.{side}.r{rnd}.json"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.unlink(missing_ok=True)
                    cmd = cfg.fill(w.command, str(out))
                    v.commands.setdefault(f"bench.{w.name}", " ".join(cfg.fill(w.command, "OUT.json")))
                    r = self._run(f"{w.name}.{side}.r{rnd}", cmd, tree, sha, w.timeout_minutes, v)
                    try:
                        if r.rc != 0:
                            raise ValueError(f"exit {r.rc}: {tail(r.log, 3)}")
                        doc = json.loads(out.read_text())
                        for m in cfg.metrics:
                            if m.workload == w.name:
                                figures[side].setdefault(m.name, []).append(ab.lookup(doc, m.key))
                    except (OSError, ValueError, KeyError) as e:
                        msg = f"workload {w.name} failed on the {side} (round {rnd}): {e}"
                        if side == "base":
                            raise JudgeError(msg) from None
                        raise _CandidateBenchFailed(msg) from None
                    if isinstance(doc.get("roofline"), dict):
                        v.roofline.setdefault(side, {})[w.name] = doc["roofline"]
                self.log(
                    f"judge: round {rnd} {side}: "
                    + ", ".join(f"{k} {vals[-1]:.4g}" for k, vals in figures[side].items())
                )
        return figures


class _CandidateBenchFailed(RuntimeError):
    pass


def _oracle_result(out: Path, r: Ran) -> tuple[bool, str]:
    """(passed, summary): passed needs exit 0 *and* a JSON verdict saying so."""
    try:
        doc = json.loads(out.read_text())
    except (OSError, ValueError):
        return False, f"exit {r.rc}, no JSON verdict" + (
            " (timed out)" if r.timed_out else ""
        ) + f": {tail(r.log, 3)}"
    checks = doc.get("checks") if isinstance(doc.get("checks"), list) else []
    failed = doc.get("failed") if isinstance(doc.get("failed"), list) else []
    n = f"{len(checks) - len(failed)}/{len(checks)} checks passed" if checks else ""
    ok = r.rc == 0 and doc.get("passed") is True
    if ok:
        return True, n or "passed"
    names = ", ".join(str(f.get("name", f)) if isinstance(f, dict) else str(f) for f in failed[:6])
    return False, f"exit {r.rc}; {n}" + (f"; failed: {names}" if names else "")
