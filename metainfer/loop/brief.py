"""The brief an agent gets each iteration: a markdown file with the goal, the boundary, the rules the
judge applies, the current figures (with their roofline share where the benchmark reports one), the
latest profile, the knowledge base's kept and reverted records and the last verdicts with reasons."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from metainfer.loop import gitops, record
from metainfer.loop.config import LoopConfig
from metainfer.loop.judge import protected_patterns, run_command

LAST_VERDICTS = 10
KB_REVERTED = 20


def _kb(repo: Path, cfg: LoopConfig) -> list[str]:
    from metainfer.kb.records import load_all

    d = record.records_dir(repo, cfg)
    try:
        recs = load_all(d)
    except (ValueError, OSError) as e:
        return [f"(the records in {d} could not be read: {e})"]
    kept = [r for r in recs if r.status == "kept"]
    reverted = [r for r in recs if r.status == "reverted"][-KB_REVERTED:]
    out = [f"Kept ({len(kept)}; `metainfer kb show ID --dir {d}` for one in full):"]
    out += [f"- {r.id} {r.title}: {r.lesson[:160]}" for r in kept] or ["- none"]
    out += ["", f"Reverted (the last {len(reverted)}): what did not work, and why:"]
    out += [f"- {r.id} {r.title}: {r.lesson[:160]}" for r in reverted] or ["- none"]
    return out


def _roofline(roof: dict[str, Any]) -> list[str]:
    out = []
    for workload, fig in roof.items():
        shares = {k: v for k, v in fig.items() if "pct" in k and isinstance(v, int | float)}
        if shares:
            out.append(f"- {workload}: " + ", ".join(f"{k} {v:.1f}%" for k, v in shares.items()))
        elif fig.get("omitted"):
            out.append(f"- {workload}: roofline omitted ({fig['omitted']})")
    return out


def _profile(cfg: LoopConfig, wt: Path, d: Path) -> list[str]:
    if not cfg.profile_command:
        return ["(no profile command in loop.toml [agent] profile_command)"]
    cmd = cfg.fill(cfg.profile_command, str(d / "profile.json"))
    r = run_command(cmd, wt, {**os.environ}, d / "profile.log", 60 * cfg.agent_timeout_minutes)
    lines = (d / "profile.log").read_text(errors="replace").splitlines()[-40:]
    return [f"`{' '.join(cmd)}` (exit {r.rc}), its last lines:", "```", *lines, "```"]


def write(path: Path, repo: Path, cfg: LoopConfig, state: dict[str, Any], wt: Path, n: int) -> Path:
    b = cfg.boundary
    figures = state.get("figures") or {}
    lines = [
        f"# MetaInfer loop, iteration {n}",
        "",
        f"You work in the git worktree `{wt}` (detached at the ratchet's head {state_head(state)}).",
        "Make one change that makes the engine faster at the goal below without changing what it computes;",
        "commit it with a message saying what and why (the loop commits uncommitted changes itself),",
        "then exit 0.",
        "Exit non-zero to give up this iteration.",
        "",
        "## Goal",
        f"Improve **{cfg.primary}** beyond the A/B noise band (at least {100 * cfg.min_gain:.1f}%), "
        "with no other metric worse than its tolerance:",
        "",
        "| metric | better | target | tolerance | current |",
        "|---|---|---|---|---|",
    ]
    for m in cfg.metrics:
        cur = f"{figures[m.name]:.4g}" if m.name in figures else "not measured yet"
        lines.append(
            f"| {m.name} | {m.better} | {'-' if m.target is None else f'{m.target:g}'} "
            f"| {100 * m.tolerance:.1f}% | {cur} |"
        )
    lines += ["", "Roofline share of the current figures:"]
    lines += _roofline(state.get("roofline") or {}) or ["- not known yet (none measured, or a CPU run)"]
    lines += [
        "",
        "## Boundary (fixed)",
        f"target {b.target}; model {b.model or 'the embedded default model'}; dtype {b.dtype}; "
        f"device {b.device}; GPU {b.gpu}; traffic {b.traffic}",
        "",
        "## How you are judged",
        "1. The diff may not touch these paths (rejected as tampering before anything runs): "
        + ", ".join(f"`{p}`" for p in protected_patterns(repo, cfg, gitops.rev(wt, "HEAD")))
        + "; nor may added lines import the judge's modules,",
        "   transformers, or patch the interpreter (metainfer/loop/tamper.py).",
        "2. The CPU tests: " + (f"`{' '.join(cfg.tests.command)}`" if cfg.tests else "none") + ".",
        f"3. The oracle on your engine: `{' '.join(cfg.oracle.command)}`: a fail rejects whatever the speed.",
        f"4. An A/B against the head, {cfg.rounds} rounds of fresh processes, sides alternating: "
        + "; ".join(f"`{' '.join(w.command)}`" for w in cfg.workloads)
        + ".",
        "",
        "## Latest profile",
        *_profile(cfg, wt, path.parent),
        "",
        "## Knowledge base",
        *_kb(repo, cfg),
        "",
        "## Last verdicts",
    ]
    its = state.get("iterations", [])[-LAST_VERDICTS:]
    lines += [f"- iteration {it['n']}: {it['status']} ({it['category']}): {it['reason']}" for it in its] or [
        "- none yet"
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def state_head(state: dict[str, Any]) -> str:
    accepted = [it for it in state.get("iterations", []) if it.get("status") == "accepted"]
    return (accepted[-1]["candidate"] if accepted else state.get("start", ""))[:10]
