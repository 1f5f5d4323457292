"""The knowledge base: one JSON file per optimisation under `metainfer/kb/records/`.

A record says what changed, for which target, what was predicted, the measured before/after with
the command that measured it, the oracle verdict on the same build, its status and the lesson.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RECORDS_DIR = Path(__file__).resolve().parent / "records"
STATUSES = ("kept", "reverted", "superseded", "proposed")


@dataclass(frozen=True)
class Target:
    model: str = "Qwen3.6-35B-A3B"
    gpu: str = "H200"
    precision: str = "bfloat16"  # bfloat16 | fp8 | both
    traffic: str = "decode"  # decode | prefill | serving | any


@dataclass(frozen=True)
class Record:
    id: str  # "KB-" and four digits
    title: str
    date: str  # YYYY-MM-DD
    status: str
    change: str
    files: tuple[str, ...]
    prediction: str
    before: dict[str, Any]
    after: dict[str, Any]
    benchmark: str  # the command that measured before/after
    oracle: dict[str, Any]  # {"verdict": path or None, "passed": bool|None, "note": str}
    lesson: str
    target: Target = field(default_factory=Target)
    tags: tuple[str, ...] = ()
    supersedes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._check_types()
        if not re.fullmatch(r"KB-\d{4}", self.id):
            raise ValueError(f"record id must be 'KB-' and four digits, got {self.id!r}")
        if self.status not in STATUSES:
            raise ValueError(f"{self.id}: status must be one of {STATUSES}")
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", self.date):
            raise ValueError(f"{self.id}: date must be YYYY-MM-DD")
        if self.status == "kept" and self.oracle.get("passed") is False:
            raise ValueError(f"{self.id}: a kept optimisation cannot have a failing oracle verdict")
        if self.oracle.get("passed") is not None and not self.oracle.get("verdict"):
            raise ValueError(f"{self.id}: oracle 'passed' needs a verdict (a run's JSON); "
                             "use passed: null when not run")
        if str(self.oracle.get("verdict") or "").strip().lower() in ("not run", "none", "n/a"):
            raise ValueError(f"{self.id}: oracle verdict {self.oracle['verdict']!r}: "
                             "use null when the oracle did not run")
        for name in ("title", "change", "prediction", "benchmark", "lesson"):
            if not str(getattr(self, name)).strip():
                raise ValueError(f"{self.id}: {name} must not be empty")

    def _check_types(self) -> None:
        """Every field's type, not just its presence: a record is read by code (kb list, the loop)."""
        for name in ("id", "title", "date", "status", "change", "prediction", "benchmark", "lesson"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{self.id!r}: {name} must be a string")
        for name in ("before", "after", "oracle"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{self.id}: {name} must be an object")
        for name in ("files", "tags", "supersedes"):
            if not all(isinstance(x, str) for x in getattr(self, name)):
                raise ValueError(f"{self.id}: {name} must be a list of strings")
        if set(self.oracle) - {"verdict", "passed", "note"}:
            raise ValueError(f"{self.id}: oracle keys are verdict, passed and note")
        if self.oracle.get("passed") not in (True, False, None):
            raise ValueError(f"{self.id}: oracle passed must be true, false or null, "
                            f"got {self.oracle.get('passed')!r}")
        for key in ("verdict", "note"):
            if not isinstance(self.oracle.get(key), (str, type(None))):
                raise ValueError(f"{self.id}: oracle {key} must be a string or null")
        for name, v in asdict(self.target).items():
            if not isinstance(v, str):
                raise ValueError(f"{self.id}: target.{name} must be a string")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        d = dict(d)
        d["target"] = Target(**d.get("target", {}))
        for key in ("files", "tags", "supersedes"):
            d[key] = tuple(d.get(key, ()))
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("files", "tags", "supersedes"):
            d[key] = list(d[key])
        return d


def load_all(directory: Path = RECORDS_DIR) -> list[Record]:
    """Every record, sorted by id; raises on a malformed file (naming it)."""
    out = []
    for f in sorted(directory.glob("KB-*.json")):
        try:
            rec = Record.from_dict(json.loads(f.read_text()))
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{f.name}: {e}") from None
        if not f.name.startswith(rec.id):
            raise ValueError(f"{f.name}: file name does not start with its id {rec.id}")
        out.append(rec)
    ids = [r.id for r in out]
    if len(ids) != len(set(ids)):
        raise ValueError("duplicate record ids")
    return out


def next_id(directory: Path = RECORDS_DIR) -> str:
    nums = [int(m.group(1)) for f in directory.glob("KB-*.json") if (m := re.match(r"KB-(\d{4})", f.name))]
    return f"KB-{max(nums, default=0) + 1:04d}"


def save(rec: Record, directory: Path = RECORDS_DIR) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", rec.title.lower()).strip("-")[:48]
    path = directory / f"{rec.id}-{slug}.json"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec.to_dict(), indent=2) + "\n")
    return path


def query(records: list[Record], status: str | None = None, text: str | None = None,
          precision: str | None = None) -> list[Record]:
    out = []
    for r in records:
        if status and r.status != status:
            continue
        if precision and r.target.precision not in (precision, "both"):
            continue
        if text and text.lower() not in json.dumps(r.to_dict()).lower():
            continue
        out.append(r)
    return out
