"""Every environment variable MetaInfer reads, typed and documented, in one place.

`settings()` reads the environment once (at its first call) into a frozen `Settings`; no other module
reads os.environ. Tests and in-process A/Bs change values with `override(...)` (a context manager), or
re-read the environment with `reload()`. An invalid value raises ValueError at that first read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    api_key: str | None = None
    """METAINFER_API_KEY: `metainfer serve` requires `Authorization: Bearer KEY` on /v1/* (--api-key wins)."""

    cache_dir: Path = Path.home() / ".cache" / "metainfer"
    """METAINFER_CACHE: the folder of built CUDA kernels (kernels/cuda/launch.py keeps cubins in cuda/)."""

    pdl: bool = True
    """METAINFER_PDL: 0 launches no kernel with programmatic dependent launch (profiles, debugging)."""

    fp8_tuned: Path | None = None
    """METAINFER_FP8_TUNED: a JSON {"configs": {key: config}} whose keys override the committed
    weight-streaming table (kernels/fp8_skinny_<gpu>.json, else _h200): a sweep's output, tried before it is
    committed."""

    moe_tuned: Path | None = None
    """METAINFER_MOE_TUNED: the same for the experts' table (kernels/moe_pair_<gpu>.json, else _h200)."""

    triton_interpret: bool = False
    """TRITON_INTERPRET: Triton's own switch: kernels run on its CPU interpreter (tests, CPU runs)."""

    git_commit: str | None = None
    """GIT_COMMIT: the commit result files record, for a copy of the tree without .git."""


ENV = {  # field -> its variable
    "api_key": "METAINFER_API_KEY",
    "cache_dir": "METAINFER_CACHE",
    "pdl": "METAINFER_PDL",
    "fp8_tuned": "METAINFER_FP8_TUNED",
    "moe_tuned": "METAINFER_MOE_TUNED",
    "triton_interpret": "TRITON_INTERPRET",
    "git_commit": "GIT_COMMIT",
}
_TYPES = {f.name: f.type for f in dataclasses.fields(Settings)}
assert set(ENV) == set(_TYPES), "every field has its variable"


def parse(name: str, raw: str) -> object:
    """The value of field `name` that the text `raw` (as its variable would hold it) gives."""
    kind = _TYPES[name]
    if kind == "bool":
        if raw.lower() not in ("0", "1", "false", "true", "off", "on"):
            raise ValueError(f"{ENV[name]} must be 0 or 1; got {raw!r}")
        return raw.lower() in ("1", "true", "on")
    if kind.startswith("Path"):
        return Path(raw).expanduser()
    return raw


def read(environ: Mapping[str, str]) -> Settings:
    """The settings an environment gives (unset or empty variables: the defaults)."""
    return Settings(**{name: parse(name, environ[var]) for name, var in ENV.items() if environ.get(var)})


_CURRENT: Settings | None = None


def settings() -> Settings:
    """The process's settings, read from the environment at the first call."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = read(os.environ)
    return _CURRENT


def reload() -> Settings:
    """Reads the environment again (a test that set variables, a process that changed its own)."""
    global _CURRENT
    _CURRENT = read(os.environ)
    return _CURRENT


@contextlib.contextmanager
def override(**values: object) -> Iterator[Settings]:
    """The settings with `values` (field names) replaced inside the block, restored after it."""
    global _CURRENT
    before = settings()
    _CURRENT = dataclasses.replace(before, **values)
    try:
        yield _CURRENT
    finally:
        _CURRENT = before
