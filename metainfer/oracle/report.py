"""The verdict as a table for people and a JSON file for benchmark results to point at."""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
from pathlib import Path
from typing import Any

from metainfer.oracle.verify import Verdict
from metainfer.runinfo import git, jsonable, package_version


def environment(device: str) -> dict[str, Any]:
    """GPU, software versions, git commit (and whether the tree was dirty), UTC date."""
    import torch

    gpu = "none"
    if device.startswith("cuda") and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(torch.device(device))
    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "triton": package_version("triton"),
        "python": platform.python_version(),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "date_utc": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        "hostname": platform.node(),
    }


def _fmt(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    if x == int(x) and abs(x) < 1e6:
        return str(int(x))
    return f"{x:.4g}"


def format_table(v: Verdict) -> str:
    """One line per check: name, figure, gate, PASS/FAIL, detail; then the overall verdict."""
    rows = [(c.name, _fmt(c.figure), c.gate, "PASS" if c.passed else "FAIL", c.detail) for c in v.checks]
    head = ("check", "figure", "gate", "", "detail")
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(4)]
    line = lambda r: "  ".join(r[k].ljust(widths[k]) for k in range(4)) + "  " + r[4]  # noqa: E731
    out = [line(head), "  ".join("-" * w for w in widths) + "  " + "-" * 6]
    out += [line(r) for r in rows]
    n_fail = len(v.failed)
    out.append(
        f"\nverdict: {'PASS' if v.passed else 'FAIL'} ({len(v.checks) - n_fail}/{len(v.checks)} checks passed"
        + (f"; failed: {', '.join(v.failed)})" if n_fail else ")")
    )
    return "\n".join(out)


def write_verdict(path: str | Path, v: Verdict) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(jsonable(v.to_dict()), indent=2) + "\n")
    return p
