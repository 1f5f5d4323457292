"""A judge's verdict as a knowledge-base record (metainfer/kb/records.py): kept when accepted, reverted
otherwise, with the figures, the commands, the GPU, both commits and the diff's sha256."""

from __future__ import annotations

from datetime import date
from pathlib import Path

from metainfer.kb.records import RECORDS_DIR, Record, Target, next_id, save
from metainfer.loop.config import LoopConfig
from metainfer.loop.judge import Verdict


def records_dir(repo: Path, cfg: LoopConfig) -> Path:
    """loop.toml's kb_dir (relative to the repository), else the repository's own records folder
    (the installed package's when the repository has none)."""
    if cfg.kb_dir:
        d = Path(cfg.kb_dir)
        return d if d.is_absolute() else repo / d
    own = repo / "metainfer" / "kb" / "records"
    return own if own.is_dir() else RECORDS_DIR


def _figures(v: Verdict, side: str) -> dict:
    out: dict = {"commit": v.base if side == "base" else v.candidate}
    for name, f in v.figures.items():
        out[name] = f[f"{side}_median"]
        out[f"{name}_runs"] = list(f[side])
    if side == "candidate":
        out["diff_sha256"] = v.diff_sha256
        if v.figures:
            p = next(iter(v.figures.values()))
            out["noise_band"] = p["band"]
    return out


def build(v: Verdict, cfg: LoopConfig, rid: str, repo: Path | None = None) -> Record:
    """The record of verdict `v`; the oracle's verdict file named relative to `repo` when inside it."""
    b = cfg.boundary
    bench = "; ".join(f"{k}: {c}" for k, c in v.commands.items() if k.startswith("bench."))
    rounds = f" ({cfg.rounds} rounds, fresh processes, sides alternating)" if bench else ""
    oracle_note = v.oracle.get("summary") or ""
    verdict, passed = v.oracle.get("verdict"), v.oracle.get("passed")
    if verdict and repo is not None and Path(verdict).resolve().is_relative_to(repo.resolve()):
        verdict = Path(verdict).resolve().relative_to(repo.resolve()).as_posix()
    if passed is None:
        oracle_note = f"not run: rejected ({v.category}) before the oracle"
    elif not verdict:  # it ran but wrote no verdict: nothing to point at
        passed, oracle_note = None, f"ran without a JSON verdict: {oracle_note}"
    change = f"{v.subject} (commit {v.candidate[:12]} on {v.base[:12]}; diff sha256 {v.diff_sha256[:16]})"
    return Record(
        id=rid,
        title=f"loop: {v.subject}"[:100] or "loop: (no subject)",
        date=date.today().isoformat(),
        status="kept" if v.accepted else "reverted",
        change=change,
        files=tuple(v.files),
        prediction=f"{cfg.primary} improves beyond the A/B noise band (at least {100 * cfg.min_gain:.1f}%) "
        "with the oracle passing and no other goal metric worse than its tolerance",
        before=_figures(v, "base"),
        after=_figures(v, "candidate"),
        benchmark=(bench + rounds) or "not measured",
        oracle={"verdict": verdict if passed is not None else None, "passed": passed, "note": oracle_note},
        lesson=f"{'accepted' if v.accepted else 'rejected'} ({v.category}): {v.reason}",
        target=Target(
            model=b.model or "default (metainfer/assets/stdlib)",
            gpu=v.gpu,
            precision=b.dtype,
            traffic=b.traffic,
        ),
        tags=("loop", v.category, f"commit:{v.candidate}", f"diff-sha256:{v.diff_sha256}"),
    )


def write(v: Verdict, cfg: LoopConfig, repo: Path) -> Path:
    d = records_dir(repo, cfg)
    return save(build(v, cfg, next_id(d), repo), d)
