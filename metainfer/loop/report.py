"""A run's report: report.md (a table of the iterations) and report.png (the goal metrics of the ratchet's
head over the iterations; skipped, with a note in the report, when matplotlib is not installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from metainfer.loop.config import LoopConfig


def series(cfg: LoopConfig, state: dict[str, Any]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """metric -> {"head": [(iteration, the ratchet head's figure after it)], "candidate": [(iteration, the
    candidate's figure)]} over the judged iterations; the head's line starts at iteration 0 with the first
    base measured."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {
        m.name: {"head": [], "candidate": []} for m in cfg.metrics
    }
    for it in state.get("iterations", []):
        for name, f in (it.get("figures") or {}).items():
            if name not in out:
                continue
            head = out[name]["head"]
            if not head:
                head.append((0, f["base_median"]))
            head.append((it["n"], f["candidate_median"] if it["status"] == "accepted" else f["base_median"]))
            out[name]["candidate"].append((it["n"], f["candidate_median"]))
    return out


def plot(cfg: LoopConfig, state: dict[str, Any], path: Path) -> str | None:
    """Writes the plot; returns why not when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    data = series(cfg, state)
    fig, axes = plt.subplots(len(data), 1, figsize=(7, 2.4 * len(data)), squeeze=False)
    for ax, (name, s) in zip(axes[:, 0], data.items()):
        head, cand = s["head"], s["candidate"]
        if head:
            ax.plot(
                [p[0] for p in head],
                [p[1] for p in head],
                marker="o",
                drawstyle="steps-post",
                label="ratchet head",
            )
            ax.scatter(
                [p[0] for p in cand], [p[1] for p in cand], marker="x", color="gray", label="candidate"
            )
        m = cfg.metric(name)
        values = [p[1] for p in head + cand]
        if m.target is not None and (not values or min(values) / 3 <= m.target <= 3 * max(values)):
            ax.axhline(m.target, linestyle="--", color="gray", label="target")
        elif m.target is not None:
            name = f"{name} (target {m.target:g})"
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if head:
            ax.legend(loc="best", fontsize="small")
    axes[-1, 0].set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _fmt(f: dict[str, Any] | None) -> str:
    if not f:
        return "-"
    return (
        f"{f['base_median']:.4g} -> {f['candidate_median']:.4g} ({100 * f['change']:+.1f}%, "
        f"band {100 * f['band']:.1f}%)"
    )


def write(root: Path, cfg: LoopConfig, state: dict[str, Any], with_plot: bool = True) -> Path:
    """report.md, and report.png when `with_plot` (else the one there stays)."""
    its = state.get("iterations", [])
    accepted = sum(it["status"] == "accepted" for it in its)
    lines = [
        "# metainfer loop run",
        "",
        f"Started {state.get('started')} at {state.get('start', '')[:10]}; "
        f"ratchet branch `{state.get('ratchet')}`; agent `{state.get('agent')}`.",
        f"{len(its)} iterations, {accepted} accepted; {state.get('elapsed_s', 0) / 60:.1f} min wall, "
        f"{state.get('device_s', 0) / 60:.1f} min in the judge's commands."
        + (f" Stopped: {state['stopped']}." if state.get("stopped") else ""),
        "",
        f"| # | status | candidate | {cfg.primary} (base -> candidate) | reason | KB record |",
        "|---|---|---|---|---|---|",
    ]
    for it in its:
        rec = Path(it["record"]).name.split("-")[0:2] if it.get("record") else None
        lines.append(
            f"| {it['n']} | {it['status']} | {(it.get('candidate') or '-')[:10]} | "
            f"{_fmt((it.get('figures') or {}).get(cfg.primary))} | {it['reason'].replace('|', '/')[:200]} | "
            f"{'-'.join(rec) if rec else '-'} |"
        )
    note = (
        "no plot yet: no iteration"
        if not its
        else plot(cfg, state, root / "report.png")
        if with_plot
        else None
    )
    lines += ["", note or "![goal metrics](report.png)", ""]
    path = root / "report.md"
    path.write_text("\n".join(lines))
    return path
