"""Facts every result file records: git commit, package versions, and JSON-safe values."""

from __future__ import annotations

import math
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from metainfer.settings import settings

REPO_ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], cwd: Path | None = None) -> str | None:
    """A command's stripped stdout, or None when it is missing or fails."""
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git(*args: str) -> str | None:
    """`git ARGS` in this checkout. $GIT_COMMIT, when set, is the answer to rev-parse HEAD: a copy
    of the tree run elsewhere (the GPU machine) may carry no .git, or a stale one."""
    if args == ("rev-parse", "HEAD") and settings().git_commit:
        return settings().git_commit
    return run(["git", *args], cwd=REPO_ROOT)


def package_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def jsonable(x: Any) -> Any:
    """NaN -> None, +-inf -> "inf"/"-inf", Paths -> str, 0-d tensors/numpy scalars -> numbers."""
    if isinstance(x, float):
        return None if math.isnan(x) else (("inf" if x > 0 else "-inf") if math.isinf(x) else x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item") and callable(x.item):
        return jsonable(x.item())
    return x
