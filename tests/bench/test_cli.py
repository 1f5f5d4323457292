"""`metainfer bench serve | report | compare` end to end against fake servers."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from fake_openai import Behaviour, FakeServer

from metainfer.bench.compare import parse_workloads
from metainfer.bench.env import verdict_info
from metainfer.cli import main

FAKE = Path(__file__).resolve().parent / "fake_openai.py"


@pytest.mark.parametrize("fake_server", [Behaviour(ttft_ms=20.0, itl_ms=5.0)], indirect=True)
def test_serve_writes_result_and_report(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    verdict = tmp_path / "verdict.json"
    verdict.write_text(json.dumps({"passed": True, "checks": [],
                                   "figures": {"coverage": {"max_decode_batch": 2, "max_position": 16}}}))
    out = tmp_path / "r.json"
    args = [
        "bench",
        "serve",
        "--base-url",
        fake_server.url,
        "--model",
        "fake-model",
        "--dataset",
        "random",
        "--input-len",
        "12",
        "--output-len",
        "4",
        "--num-prompts",
        "4",
        "--max-concurrency",
        "2",
        "--ignore-eos",
        "--seed",
        "5",
        "--warmup",
        "1",
        "--label",
        "fake",
        "--workload",
        "c2",
        "--json",
        str(out),
        "--verdict",
        str(verdict),
    ]
    assert main(args) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    obj = json.loads(out.read_text())
    assert obj["kind"] == "serve" and obj["engine"] == "fake" and obj["workload"] == "c2"
    for key in ("gpu", "driver", "torch", "triton", "git_commit", "date_utc"):
        assert key in obj["env"]
    assert obj["env"]["gpu"]  # a name or "none"
    assert "bench serve" in obj["command"] and obj["verdict"]["passed"] is True
    assert obj["metrics"]["completed"] == 4 and obj["metrics"]["total_output_tokens"] == 16
    assert obj["metrics"]["request_rate"] == "inf"
    assert obj["config"]["dataset"]["input_len"] == 12 and len(obj["requests"]) == 4
    assert obj["roofline"]["decode_ceiling_tok_s"] > 0
    assert all(len(b["prompt"]) == 12 for b in fake_server.fake.bodies)

    rep = tmp_path / "rep"
    assert main(["bench", "report", str(out), "--out", str(rep)]) == 0
    md = (rep / "report.md").read_text()
    assert "| c2 | fake | serve | 2 | 12/4 |" in md
    assert (rep / "decode_tok_s.png").stat().st_size > 1000 and (rep / "ttft_ms.png").is_file()


@pytest.mark.parametrize("fake_server", [Behaviour(ttft_ms=1.0, itl_ms=1.0, fail_every=2)], indirect=True)
def test_serve_exits_1_on_failures_but_writes_json(fake_server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            fake_server.url,
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--num-prompts",
            "4",
            "--max-concurrency",
            "1",
            "--json",
            str(out),
        ]
    )
    assert rc == 1
    assert json.loads(out.read_text())["metrics"]["failed"] == 2
    assert {b["model"] for b in fake_server.fake.bodies} == {"fake-model"}  # found via /v1/models


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert main(["bench", "serve", "--dataset", "sharegpt", "--num-prompts", "1"]) == 2
    assert main(["bench", "serve", "--model", "x", "--dataset", f"file:{tmp_path / 'x.jsonl'}"]) == 2
    assert main(["bench", "serve", "--config", str(tmp_path / "nope.json")]) == 2
    assert main(["bench", "compare", "--workload", "c0"]) == 2
    assert main(["bench", "report", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert main(["bench"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["bench", "roofline", "--dtype", "int4"])
    assert e.value.code == 2


def test_parse_workloads() -> None:
    ws = parse_workloads("c1,ttft,c32", 1024, 512)
    assert [(w.name, w.input_len, w.output_len, w.max_concurrency, w.num_prompts) for w in ws] == [
        ("c1", 1024, 512, 1, 4),
        ("ttft", 1024, 1, 1, 8),
        ("c32", 1024, 512, 32, 128),
    ]
    assert parse_workloads("c4", 8, 8, num_prompts=2)[0].num_prompts == 2


def test_verdict_info(tmp_path: Path) -> None:
    assert verdict_info(None) is None
    bad = verdict_info(str(tmp_path / "missing.json"))
    assert bad is not None and bad["passed"] is None and "error" in bad


def test_compare_two_fake_engines(tmp_path: Path, capsys) -> None:
    def cmd(itl: float) -> str:
        exe = f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE))}"
        return f"{exe} --port {{port}} --ttft-ms 10 --itl-ms {itl}"

    out = tmp_path / "cmp"
    rc = main(
        [
            "bench",
            "compare",
            "--engine-cmd",
            f"slow={cmd(8)}",
            "--engine-cmd",
            f"fast={cmd(2)}",
            "--workload",
            "c1,ttft,c2",
            "--input-len",
            "8",
            "--output-len",
            "6",
            "--num-prompts",
            "2",
            "--warmup",
            "0",
            "--baseline",
            "slow",
            "--startup-timeout",
            "60",
            "--out",
            str(out),
        ]
    )
    log = capsys.readouterr().out
    assert rc == 0, log
    names = sorted(p.name for p in out.glob("*.json"))
    assert names == sorted(f"{e}-{w}.json" for e in ("slow", "fast") for w in ("c1", "ttft", "c2"))
    obj = json.loads((out / "fast-c1.json").read_text())
    assert obj["engine"] == "fast" and obj["metrics"]["failed"] == 0 and "server_command" in obj
    assert json.loads((out / "slow-ttft.json").read_text())["metrics"]["total_output_tokens"] == 2
    md = (out / "report.md").read_text()
    assert "Ratios vs slow" in md and "| c1 | fast |" in md
    assert (out / "throughput_vs_concurrency.png").is_file()
    assert "stopped slow" in log and "stopped fast" in log
    assert (out / "slow.server.log").is_file()


def test_compare_skips_unavailable_engine(tmp_path: Path, capsys, monkeypatch) -> None:
    import metainfer.bench.compare as compare

    monkeypatch.setattr(compare, "find_spec", lambda name: None)
    rc = main(["bench", "compare", "--engine", "vllm", "--workload", "c1", "--out", str(tmp_path)])
    assert rc == 1  # nothing ran
    assert "skipping engine vllm: vllm is not importable" in capsys.readouterr().out


@pytest.mark.parametrize("fake_server", [Behaviour(ttft_ms=5.0, itl_ms=1.0, fail_every=1)], indirect=True)
def test_serve_prints_no_table_when_every_request_failed(fake_server: FakeServer, capsys) -> None:
    args = ["bench", "serve", "--base-url", fake_server.url, "--model", "fake-model", "--input-len", "8",
            "--output-len", "4", "--num-prompts", "3", "--warmup", "0"]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert "Serving Benchmark Result" not in out and "nan" not in out
    assert err.startswith("error: all 3 requests failed")
