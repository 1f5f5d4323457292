"""`metainfer loop tune`: sweep a kernel's launch/tile configs at the engine's shapes, keep the fastest config
per shape that agrees with the kernel's reference, write the winners into the kernel's tuned table for this
GPU, commit that on top of the ratchet's head and judge the commit end to end like any candidate.

A kernel is anything with the `Kernel` interface below; `KERNELS` names the real ones (GPU only).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from metainfer.loop import gitops, record
from metainfer.loop.config import LoopConfig
from metainfer.loop.judge import Judge, Verdict

KERNELS = {"fp8_skinny": "metainfer.loop.tune_gpu:Fp8Skinny"}  # name -> module:class (needs a GPU)


class Kernel(Protocol):
    name: str
    tolerance: float  # the largest error against the kernel's reference a config may have

    def table(self, gpu: str) -> str:
        """The tuned table's path in the repository for this GPU."""
        ...

    def keys(self) -> list[str]:
        """The table keys of the shapes the engine runs."""
        ...

    def default(self, key: str) -> dict:
        """The config the engine uses today at this shape."""
        ...

    def candidates(self, key: str) -> list[dict]: ...

    def measure(self, key: str, config: dict) -> tuple[float, float]:
        """(time in us, error against the kernel's reference) of one config; raises when it cannot run."""
        ...


@dataclass(frozen=True)
class Trial:
    key: str
    config: dict
    us: float | None
    error: float | None
    ok: bool
    note: str = ""


def sweep(
    kernel: Kernel, min_gain: float = 0.02, log: Callable[[str], None] = print
) -> tuple[dict[str, dict], list[Trial]]:
    """(winners, every trial): winners[key] = {"config", "us", "default_us"} where the fastest config that
    passes the reference check beats the default by more than min_gain."""
    winners, trials = {}, []
    for key in kernel.keys():
        rows = []
        for i, cfg in enumerate([kernel.default(key), *kernel.candidates(key)]):
            try:
                us, err = kernel.measure(key, cfg)
            except Exception as e:  # a config the compiler or the launcher refuses
                rows.append(Trial(key, cfg, None, None, False, f"{type(e).__name__}: {e}"[:200]))
                continue
            ok = err <= kernel.tolerance
            rows.append(
                Trial(
                    key,
                    cfg,
                    us,
                    err,
                    ok,
                    "default" if i == 0 else ("" if ok else "disagrees with the reference"),
                )
            )
        trials += rows
        default = rows[0]
        good = [t for t in rows if t.ok and t.us is not None]
        if not good:
            log(f"tune: {key}: no config agrees with the reference")
            continue
        best = min(good, key=lambda t: t.us)
        base_us = default.us if default.ok else None
        if best is not default and (base_us is None or best.us < base_us * (1 - min_gain)):
            winners[key] = {"config": best.config, "us": best.us, "default_us": base_us}
            log(f"tune: {key}: {base_us} -> {best.us:.2f} us {best.config}")
        else:
            log(f"tune: {key}: the default stays ({base_us} us)")
    return winners, trials


def write_table(path: Path, gpu: str, kernel: str, winners: dict[str, dict]) -> None:
    """Merges the winners' configs into the table at `path` ({"gpu", "source", "configs": {key: config}})."""
    doc: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    doc["gpu"] = gpu
    note = (
        f"metainfer loop tune --kernel {kernel}, {datetime.now(UTC).isoformat(timespec='seconds')}: "
        + ", ".join(f"{k} {w['default_us']} -> {w['us']:.2f} us" for k, w in winners.items())
    )
    doc["source"] = f"{doc['source']}; {note}" if doc.get("source") else note
    doc.setdefault("configs", {}).update({k: w["config"] for k, w in winners.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def load_kernel(name: str, **options: Any) -> Kernel:
    mod, _, cls = KERNELS[name].partition(":")
    return getattr(importlib.import_module(mod), cls)(**options)


@dataclass
class TuneResult:
    winners: dict[str, dict]
    trials: list[Trial]
    commit: str | None
    verdict: Verdict | None
    message: str


def tune(
    repo: Path,
    cfg: LoopConfig,
    kernel: Kernel,
    gpu: str,
    root: Path,
    base: str | None = None,
    judge: bool = True,
    min_gain: float = 0.02,
    log: Callable[[str], None] = print,
) -> TuneResult:
    """Sweep, commit the table on top of `base` (default: the ratchet's head, else HEAD), judge it, record
    the verdict and ratchet it when accepted."""
    ratchet = f"refs/heads/{cfg.ratchet}"
    head = gitops.rev(repo, base or (ratchet if gitops.exists(repo, ratchet) else "HEAD"))
    winners, trials = sweep(kernel, min_gain, log)
    root.mkdir(parents=True, exist_ok=True)
    (root / "trials.json").write_text(json.dumps([t.__dict__ for t in trials], indent=1))
    if not winners:
        return TuneResult(winners, trials, None, None, "no config beats the defaults: nothing to judge")
    wt = gitops.worktree_add(repo, root / "worktree", head)
    try:
        table = kernel.table(gpu)
        write_table(wt / table, gpu, kernel.name, winners)
        gitops.commit_all(
            wt, f"{kernel.name}: tuned configs for {gpu} at {len(winners)} shapes (metainfer loop tune)"
        )
        cand = gitops.rev(wt, "HEAD")
    finally:
        gitops.worktree_remove(repo, wt)
    gitops.set_ref(repo, f"refs/loop/tune/{kernel.name}", cand)
    if not judge:
        return TuneResult(
            winners, trials, cand, None, f"committed {cand[:10]} (refs/loop/tune/{kernel.name}), not judged"
        )
    v = Judge(repo, cfg, root / "judge", log).judge(head, cand)
    v.record = str(record.write(v, cfg, repo))
    if v.accepted:
        if not gitops.exists(repo, ratchet):
            gitops.fast_forward(repo, cfg.ratchet, head)
        v.ratchet = gitops.fast_forward(repo, cfg.ratchet, cand)
    v.save(root / "verdict.json")
    return TuneResult(winners, trials, cand, v, f"{'accepted' if v.accepted else 'rejected'}: {v.reason}")
