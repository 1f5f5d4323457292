"""Knowledge base: records validate, round-trip, are queryable; the committed records are valid."""

from __future__ import annotations

import json

import pytest

from metainfer.cli import main
from metainfer.kb.records import Record, load_all, next_id, query, save

GOOD = {
    "title": "Fuse the thing",
    "status": "kept",
    "change": "one kernel instead of two",
    "files": ["metainfer/kernels/x.py"],
    "prediction": "half the launches: -50 us/step",
    "before": {"decode_tok_s_bs1": 100},
    "after": {"decode_tok_s_bs1": 120},
    "benchmark": "python benchmarks/decode_bench.py",
    "oracle": {"verdict": "benchmarks/results/v.json", "passed": True, "note": ""},
    "lesson": "launch count matters at batch 1",
    "target": {"precision": "fp8"},
}


def test_roundtrip_and_query(tmp_path):
    rec = Record.from_dict({**GOOD, "id": next_id(tmp_path), "date": "2026-11-30"})
    assert rec.id == "KB-0001"
    save(rec, tmp_path)
    assert next_id(tmp_path) == "KB-0002"
    (loaded,) = load_all(tmp_path)
    assert loaded == rec
    assert query([loaded], status="kept", precision="fp8", text="launches") == [loaded]
    assert query([loaded], status="reverted") == []


@pytest.mark.parametrize(
    "bad",
    [{"status": "maybe"}, {"id": "KB-1"}, {"date": "30/11/2026"}, {"lesson": " "},
     {"oracle": {"passed": False}},
     {"status": "reverted", "oracle": {"verdict": None, "passed": False}},
     {"status": "proposed", "oracle": {"verdict": "not run", "passed": None}},
     {"oracle": {"verdict": "v.json", "passed": "22/22"}}, {"oracle": {"verdict": 3, "passed": None}},
     {"title": 7}, {"before": [1]}, {"files": ["a", 2]}, {"target": {"gpu": 200}}],
)
def test_invalid_records_rejected(bad):
    with pytest.raises(ValueError):
        Record.from_dict({**GOOD, "id": "KB-0001", "date": "2026-11-30", **bad})


def test_cli_add_list_show(tmp_path, capsys):
    f = tmp_path / "r.json"
    f.write_text(json.dumps(GOOD))
    assert main(["kb", "add", str(f), "--dir", str(tmp_path)]) == 0
    assert main(["kb", "list", "--dir", str(tmp_path)]) == 0
    assert "Fuse the thing" in capsys.readouterr().out
    assert main(["kb", "show", "KB-0001", "--dir", str(tmp_path)]) == 0
    assert main(["kb", "show", "KB-0009", "--dir", str(tmp_path)]) == 1
    f.write_text(json.dumps({**GOOD, "status": "nope"}))
    assert main(["kb", "add", str(f), "--dir", str(tmp_path)]) == 2


def test_committed_records_list_and_show(capsys):
    """Every shipped record goes through the CLI's listing (it reads the verdict's type)."""
    assert main(["kb", "list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(load_all())


def test_committed_records_are_valid():
    recs = load_all()
    assert all(r.benchmark and r.prediction for r in recs)
