"""`metainfer loop run`: agent, judge, ratchet, until a budget ends or the goal is met.

One iteration: a fresh worktree at the ratchet's head; the brief written (metainfer/loop/brief.py); the
agent's command run in the worktree with the brief's path; its commit (or its uncommitted changes,
committed by the loop) judged against the head; an accepted one fast-forwards the ratchet.

The run's folder holds state.json, rewritten atomically after every verdict and before every judge
(`pending`), so a run killed at any point resumes where it was: a finished verdict is never judged
again, and a pending one is adopted from its verdict.json when the judge had finished it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from metainfer.loop import brief, gitops, record, report
from metainfer.loop.config import LoopConfig
from metainfer.loop.judge import Judge, JudgeError, Verdict, run_command, tail


def save_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


class LoopRun:
    def __init__(
        self,
        repo: Path,
        cfg: LoopConfig,
        agent: str,
        root: Path,
        base: str | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.repo, self.cfg, self.agent, self.root, self.log = repo, cfg, agent, root, log
        self.state_path = root / "state.json"
        self.t_session = time.monotonic()
        root.mkdir(parents=True, exist_ok=True)
        self._lock = open(root / "lock", "w")  # held until close() (run() ends with it): one run per folder
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise ValueError(f"another metainfer loop run is using {root}") from None
        if repo in root.resolve().parents:
            gitops.exclude(repo, "/" + root.resolve().relative_to(repo).as_posix() + "/")
        if self.state_path.exists():
            self.state = json.loads(self.state_path.read_text())
            if base and gitops.rev(repo, base) != self.state["start"]:
                raise ValueError(
                    f"{root} holds a run from {self.state['start'][:10]}; --base differs "
                    "(pass no --base to resume it, or another --run-dir)"
                )
            self.log(f"loop: resuming {root} after {len(self.state['iterations'])} iterations")
        else:
            start = gitops.rev(repo, base or "HEAD")
            if gitops.exists(repo, f"refs/heads/{cfg.ratchet}"):
                head = gitops.rev(repo, f"refs/heads/{cfg.ratchet}")
                if base and head != start:
                    raise ValueError(
                        f"branch {cfg.ratchet} exists at {head[:10]}, not at --base {start[:10]}: "
                        "pass no --base to continue it, or delete it"
                    )
                start = head
            else:
                gitops.fast_forward(repo, cfg.ratchet, start)
            self.state = {
                "id": uuid.uuid4().hex[:8],
                "start": start,
                "agent": agent,
                "ratchet": cfg.ratchet,
                "started": datetime.now(UTC).isoformat(timespec="seconds"),
                "elapsed_s": 0.0,
                "device_s": 0.0,
                "iterations": [],
                "pending": None,
                "figures": {},
                "roofline": {},
                "stopped": None,
            }
            self._save()
        self.elapsed0 = float(self.state["elapsed_s"])

    # ---- state ------------------------------------------------------------------------------------
    def _save(self, plot: bool = False) -> None:
        self.state["elapsed_s"] = getattr(self, "elapsed0", 0.0) + time.monotonic() - self.t_session
        save_json(self.state_path, self.state)
        report.write(self.root, self.cfg, self.state, plot)

    def _head(self) -> str:
        return gitops.rev(self.repo, f"refs/heads/{self.cfg.ratchet}")

    def budget_left(self) -> str | None:
        """Why the run must stop now, or None."""
        cfg, st = self.cfg, self.state
        if len(st["iterations"]) >= cfg.iterations:
            return f"iteration budget spent ({cfg.iterations})"
        if self.elapsed0 + time.monotonic() - self.t_session >= 60 * cfg.wall_minutes:
            return f"wall-time budget spent ({cfg.wall_minutes:g} min)"
        if st["device_s"] >= 60 * cfg.device_minutes:
            return f"device-time budget spent ({cfg.device_minutes:g} min)"
        if goal_met(cfg, st["figures"]):
            return "goal met: " + ", ".join(
                f"{m.name} {st['figures'][m.name]:.4g}" for m in cfg.metrics if m.target is not None
            )
        return None

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> str:
        """Iterates until a budget ends or the goal is met; returns why it stopped. Releases the folder."""
        try:
            if self.state.get("pending"):
                self._finish_pending()
            while (why := self.budget_left()) is None:
                self.iteration(len(self.state["iterations"]) + 1)
            self.state["stopped"] = why
            self._save(plot=True)
            self.log(f"loop: stopped: {why}; report {self.root / 'report.md'}")
            return why
        finally:
            self.close()

    def close(self) -> None:
        self._lock.close()  # closing the file releases its lock

    def iteration(self, n: int) -> None:
        d = self.root / f"iter-{n:03d}"
        d.mkdir(parents=True, exist_ok=True)
        head = self._head()
        wt = gitops.worktree_add(self.repo, self.root / "worktree", head)
        it: dict[str, Any] = {
            "n": n,
            "base": head,
            "candidate": None,
            "status": "",
            "category": "",
            "reason": "",
            "record": None,
            "figures": {},
            "dir": str(d),
        }
        try:
            path = brief.write(d / "brief.md", self.repo, self.cfg, self.state, wt, n)
            q = shlex.quote(str(path))
            cmd = self.agent.replace("{brief}", q) if "{brief}" in self.agent else f"{self.agent} {q}"
            env = {**os.environ, "LOOP_BRIEF": str(path)}
            self.log(f"loop: iteration {n}: agent in {wt}")
            r = run_command(
                ["/bin/sh", "-c", cmd], wt, env, d / "agent.log", 60 * self.cfg.agent_timeout_minutes
            )
            it.update(agent_rc=r.rc, agent_seconds=round(r.seconds, 1))
            if r.rc != 0:
                why = "timed out" if r.timed_out else f"exit {r.rc}"
                it.update(
                    status="agent_failed",
                    category="agent",
                    reason=f"the agent failed ({why}): {tail(r.log, 3)}",
                )
                self.log(f"loop: iteration {n}: {it['reason']}")
                return self._append(it)
            gitops.commit_all(wt, f"loop iteration {n}: the agent's uncommitted changes")
            cand = gitops.rev(wt, "HEAD")
            if cand == head:
                it.update(status="no_change", category="empty", reason="the agent committed nothing")
                return self._append(it)
            it["candidate"] = cand
            gitops.set_ref(
                self.repo, f"refs/loop/{self.state['id']}/{n}", cand
            )  # keeps rejected ones reachable
        finally:
            gitops.worktree_remove(self.repo, wt)
        self.state["pending"] = it
        self._save()
        self._judge(it)

    def _judge(self, it: dict[str, Any]) -> None:
        work = Path(it["dir"]) / "judge"
        try:
            known = it["base"] in self.state.setdefault("oracle_passed", [])
            v = Judge(self.repo, self.cfg, work, self.log, True if known else None).judge(
                it["base"], it["candidate"]
            )
        except JudgeError as e:
            it.update(status="error", category="error", reason=str(e))
            self.state["pending"] = None
            self._append(it)
            raise
        v.save(work / "verdict.json")
        self._conclude(it, v, work)

    def _conclude(self, it: dict[str, Any], v: Verdict, work: Path) -> None:
        """Record, ratchet and state for a finished verdict; each step idempotent (a resume repeats
        what a kill interrupted)."""
        if v.record is None:
            v.record = str(record.write(v, self.cfg, self.repo))
            v.save(work / "verdict.json")
        if v.accepted and v.ratchet is None:
            v.ratchet = gitops.fast_forward(self.repo, self.cfg.ratchet, v.candidate)
            v.save(work / "verdict.json")
        self.state["device_s"] += v.device_s
        passed = self.state.setdefault(
            "oracle_passed", []
        )  # commits the oracle passed on: not run again there
        passed += [
            sha
            for sha, ok in ((v.candidate, v.oracle.get("passed")), (v.base, v.base_oracle))
            if ok and sha not in passed
        ]
        if v.figures:
            side = "candidate_median" if v.accepted else "base_median"
            self.state["figures"] = {k: f[side] for k, f in v.figures.items()}
        roof = v.roofline.get("candidate" if v.accepted else "base")
        if roof:  # the head's, as the figures
            self.state["roofline"] = roof
        it.update(
            status="accepted" if v.accepted else "rejected",
            category=v.category,
            reason=v.reason,
            record=v.record,
            ratchet=v.ratchet,
            judge_seconds=round(v.seconds, 1),
            figures={
                k: {x: f[x] for x in ("base_median", "candidate_median", "change", "band")}
                for k, f in v.figures.items()
            },
        )
        self.state["pending"] = None
        self._append(it)

    def _append(self, it: dict[str, Any]) -> None:
        self.state["iterations"].append(it)
        self._save(plot=True)

    def _finish_pending(self) -> None:
        it = self.state["pending"]
        work = Path(it["dir"]) / "judge"
        if (work / "verdict.json").exists():
            self.log(f"loop: iteration {it['n']}: adopting its finished verdict")
            self._conclude(it, Verdict.from_dict(json.loads((work / "verdict.json").read_text())), work)
        else:
            self.log(
                f"loop: iteration {it['n']}: its judge was interrupted; judging {it['candidate'][:10]} again"
            )
            self._judge(it)


def goal_met(cfg: LoopConfig, figures: dict[str, float]) -> bool:
    targets = [m for m in cfg.metrics if m.target is not None]
    if not targets or any(m.name not in figures for m in targets):
        return False
    return all(
        figures[m.name] >= m.target if m.better == "higher" else figures[m.name] <= m.target for m in targets
    )
