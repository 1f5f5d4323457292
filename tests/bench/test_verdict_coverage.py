"""`metainfer bench ... --verdict`: a verdict backs a figure only within what it judged.

A verdict must have passed and carry `figures.coverage` (written by `metainfer verify`); a run whose
concurrency exceeds its widest judged decode step, or whose sequences (prompt + output tokens)
exceed its longest judged context, is refused: one `error:` line on stderr, exit 2, before any
request reaches the server (or any engine is built).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_openai import Behaviour, FakeServer

from metainfer.bench.env import VerdictError, check_verdict
from metainfer.cli import main


def _verdict(tmp_path: Path, passed: bool = True, coverage: dict | None = None, name: str = "v.json") -> str:
    obj: dict = {
        "kind": "oracle-verdict",
        "passed": passed,
        "failed": [] if passed else ["decode.kl_max"],
        "checks": [],
        "figures": {},
    }
    if coverage is not None:
        obj["figures"]["coverage"] = coverage
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


COV = {"max_decode_batch": 4, "max_position": 64, "max_verify_batch": 0, "preemptions": 1}


def _serve_args(url: str, verdict: str, concurrency: int, input_len: int, output_len: int) -> list[str]:
    return [
        "bench",
        "serve",
        "--base-url",
        url,
        "--model",
        "fake-model",
        "--dataset",
        "random",
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--num-prompts",
        "8",
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--warmup",
        "1",
        "--verdict",
        verdict,
    ]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: " in err[0], err
    return err[0]


def test_check_verdict(tmp_path: Path) -> None:
    check_verdict(None, 1000, 10**6)  # no verdict: nothing to check
    ok = _verdict(tmp_path, coverage=COV)
    check_verdict(ok, 4, 64)
    cases = {
        "exceeds the widest decode step": (ok, 5, 10),
        "exceed the longest context": (ok, 1, 65),
        "no coverage section": (_verdict(tmp_path, coverage=None, name="old.json"), 1, 10),
        "did not pass": (_verdict(tmp_path, passed=False, coverage=COV, name="bad.json"), 1, 10),
        "unreadable": (str(tmp_path / "missing.json"), 1, 10),
        "lacks max_decode_batch": (_verdict(tmp_path, coverage={"preemptions": 1}, name="half.json"), 1, 10),
    }
    for why, (path, conc, tokens) in cases.items():
        with pytest.raises(VerdictError, match=why):
            check_verdict(path, conc, tokens)


@pytest.mark.parametrize("fake_server", [Behaviour(ttft_ms=1.0, itl_ms=1.0)], indirect=True)
@pytest.mark.parametrize(
    ("coverage", "concurrency", "lens", "why"),
    [
        (COV, 8, (12, 4), "concurrency 8 exceeds the widest decode step"),
        (COV, 2, (60, 8), "sequences of 68 tokens"),
        (None, 1, (4, 2), "no coverage section"),
    ],
)
def test_serve_refuses_before_any_load(
    fake_server: FakeServer, tmp_path: Path, capsys, coverage, concurrency, lens, why
) -> None:
    v = _verdict(tmp_path, coverage=coverage)
    assert main(_serve_args(fake_server.url, v, concurrency, *lens)) == 2
    assert why in _one_error_line(capsys)
    assert fake_server.fake.count == 0 and not fake_server.fake.bodies  # not one request was sent


@pytest.mark.parametrize("fake_server", [Behaviour(ttft_ms=1.0, itl_ms=1.0)], indirect=True)
def test_serve_failed_verdict_refused(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    v = _verdict(tmp_path, passed=False, coverage=COV)
    assert main(_serve_args(fake_server.url, v, 2, 12, 4)) == 2
    assert "did not pass (failed: decode.kl_max)" in _one_error_line(capsys)
    assert fake_server.fake.count == 0


@pytest.mark.parametrize("fake_server", [Behaviour(ttft_ms=1.0, itl_ms=1.0)], indirect=True)
def test_serve_within_coverage_records_it(fake_server: FakeServer, tmp_path: Path) -> None:
    v = _verdict(tmp_path, coverage=COV)
    out = tmp_path / "r.json"
    assert main([*_serve_args(fake_server.url, v, 4, 60, 4), "--json", str(out)]) == 0
    obj = json.loads(out.read_text())
    assert obj["verdict"]["passed"] is True and obj["verdict"]["coverage"] == COV
    assert fake_server.fake.count == 9  # 8 + 1 warmup


def test_offline_refuses_before_building_the_engine(tmp_path: Path, capsys, monkeypatch) -> None:
    import metainfer.bench.offline as offline

    def never(*args, **kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(offline, "offline_benchmark", never)
    v = _verdict(tmp_path, coverage=COV)
    base = ["bench", "offline", "--device", "cpu", "--dtype", "float32", "--verdict", v]
    assert main([*base, "--batch-size", "5", "--input-len", "8", "--output-len", "8"]) == 2
    assert "concurrency 5 exceeds" in _one_error_line(capsys)
    assert main([*base, "--batch-size", "1", "--input-len", "60", "--output-len", "8"]) == 2
    assert "sequences of 68 tokens" in _one_error_line(capsys)


def test_compare_refuses_before_starting_a_server(tmp_path: Path, capsys, monkeypatch) -> None:
    import metainfer.bench.compare as compare

    def never(*args, **kwargs):
        raise AssertionError("a server was started")

    monkeypatch.setattr(compare, "run_compare", never)
    v = _verdict(tmp_path, coverage=COV)
    args = [
        "bench",
        "compare",
        "--engine-cmd",
        "fake=true {port}",
        "--input-len",
        "8",
        "--output-len",
        "8",
        "--num-prompts",
        "8",
        "--verdict",
        v,
        "--out",
        str(tmp_path / "cmp"),
    ]
    assert main([*args, "--workload", "c1,c8"]) == 2  # c1 is covered, c8 is not
    assert "concurrency 8 exceeds" in _one_error_line(capsys)
    assert not (tmp_path / "cmp").exists()
