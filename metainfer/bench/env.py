"""Result metadata: machine, software, commit, date, command line, oracle verdict; JSON writing.

Every result file written by `metainfer bench` is one JSON object:
`{"kind", "engine", "workload", "env", "command", "config", "metrics", "roofline", "verdict", ...}`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from metainfer.runinfo import git, jsonable, package_version, run


@dataclass(frozen=True)
class RunEnv:
    gpu: str  # torch.cuda device name, else nvidia-smi's, else "none"
    gpu_count: int
    driver: str | None
    torch: str | None
    triton: str | None
    python: str
    git_commit: str | None
    git_dirty: bool | None
    date_utc: str  # ISO 8601
    hostname: str


def _nvidia_smi() -> tuple[list[str], str | None]:
    if not shutil.which("nvidia-smi"):
        return [], None
    out = run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if not out:
        return [], None
    rows = [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]
    return [r[0] for r in rows], (rows[0][1] if rows and len(rows[0]) > 1 else None)


def _torch_gpus() -> list[str]:
    """CUDA device names via torch; torch is imported only when a GPU may be present."""
    maybe_gpu = "torch" in sys.modules or shutil.which("nvidia-smi") or os.path.exists("/dev/nvidiactl")
    if not maybe_gpu:
        return []
    try:
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:
        return []
    return []


@lru_cache(maxsize=1)
def _static_env() -> tuple[str, int, str | None, str | None]:
    smi_gpus, driver = _nvidia_smi()
    gpus = _torch_gpus() or smi_gpus
    return (gpus[0] if gpus else "none"), len(gpus), driver, git("rev-parse", "HEAD")


def collect_env() -> RunEnv:
    gpu, count, driver, commit = _static_env()
    status = git("status", "--porcelain") if commit else None
    return RunEnv(
        gpu=gpu,
        gpu_count=count,
        driver=driver,
        torch=package_version("torch"),
        triton=package_version("triton"),
        python=sys.version.split()[0],
        git_commit=commit,
        git_dirty=(bool(status) if status is not None else None),
        date_utc=utc_now(),
        hostname=os.uname().nodename,
    )


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()


def command_line(argv: list[str] | None = None) -> str:
    import shlex

    args = sys.argv if argv is None else argv
    return " ".join(shlex.quote(a) for a in args)


def verdict_info(path: str | None) -> dict[str, Any] | None:
    """The oracle verdict a result relies on: its path, `passed` field (None if unreadable) and
    coverage (`figures.coverage`: what the verdict judged, None if it has none)."""
    if not path:
        return None
    p = Path(path)
    passed: bool | None = None
    cov = None
    error = None
    try:
        obj = json.loads(p.read_text())
        passed = obj.get("passed")
        cov = (obj.get("figures") or {}).get("coverage")
    except (OSError, ValueError, AttributeError) as e:
        error = f"{type(e).__name__}: {e}"
    info: dict[str, Any] = {"path": str(p.resolve()), "passed": passed, "coverage": cov}
    if error:
        info["error"] = error
    return info


class VerdictError(ValueError):
    """A verdict that cannot back the run asked for (a usage error: exit 2, before any load)."""


def check_verdict(path: str | None, concurrency: int, seq_tokens: int) -> None:
    """Raises VerdictError unless the verdict at `path` passed and its coverage (`figures.coverage`,
    written by `metainfer verify`) spans the run: `concurrency` sequences decoding at once at most
    its widest judged decode step (`max_decode_batch`), and sequences of `seq_tokens` (prompt +
    output) tokens at most its longest judged context (`max_position`). No verdict: no check."""
    if not path:
        return
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise VerdictError(f"verdict {path} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict) or obj.get("passed") is not True:
        failed = obj.get("failed") if isinstance(obj, dict) else None
        raise VerdictError(f"verdict {path} did not pass (failed: {', '.join(failed or []) or '?'}): "
                           "no result may rely on it")
    cov = (obj.get("figures") or {}).get("coverage") if isinstance(obj.get("figures"), dict) else None
    if not isinstance(cov, dict):
        raise VerdictError(f"verdict {path} has no coverage section (figures.coverage): it cannot show "
                           "what it judged; run `metainfer verify` again")
    width, longest = cov.get("max_decode_batch"), cov.get("max_position")
    if not isinstance(width, int) or not isinstance(longest, int):
        raise VerdictError(f"verdict {path}: coverage lacks max_decode_batch / max_position")
    if concurrency > width:
        raise VerdictError(f"concurrency {concurrency} exceeds the widest decode step verdict {path} "
                           f"judged ({width} sequences)")
    if seq_tokens > longest:
        raise VerdictError(f"sequences of {seq_tokens} tokens (prompt + output) exceed the longest "
                           f"context verdict {path} judged ({longest} tokens)")


def build_result(
    kind: str,
    engine: str,
    workload: str,
    config: dict[str, Any],
    metrics: dict[str, Any],
    roofline: dict[str, Any] | None = None,
    verdict: str | None = None,
    argv: list[str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A result object with full metadata (not yet written)."""
    return {
        "kind": kind,
        "engine": engine,
        "workload": workload,
        "env": asdict(collect_env()),
        "command": command_line(argv),
        "process_argv": list(sys.argv),
        "config": config,
        "metrics": metrics,
        "roofline": roofline,
        "verdict": verdict_info(verdict),
        **extra,
    }


def write_json(path: str | Path, obj: dict[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(jsonable(obj), indent=2, sort_keys=False) + "\n")
    return p
