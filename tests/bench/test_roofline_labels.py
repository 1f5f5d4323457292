"""The roofline rows of `bench serve` / `bench offline` / `bench report` name the GPU and model they
assume, and are left out (one line saying why) on a CPU run or when the server serves another model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_openai import Behaviour, FakeServer
from test_offline import FakeLLM, _run

from metainfer.bench.offline import OfflineConfig
from metainfer.bench.roofline import assumption_label, model_label
from metainfer.cli import main
from metainfer.config import DEFAULT_MODEL_DIR, FULL_CONFIG


def test_assumption_labels() -> None:
    assert model_label(FULL_CONFIG) == "Qwen3.6-35B-A3B"
    assert model_label(DEFAULT_MODEL_DIR / "config.json") == "stdlib"
    assert assumption_label(FULL_CONFIG, "fp8") == "H200 / Qwen3.6-35B-A3B FP8"
    assert assumption_label(FULL_CONFIG, "bfloat16", 3.35) == "a 3.35 TB/s GPU / Qwen3.6-35B-A3B BF16"
    fp8_head = assumption_label(FULL_CONFIG, "fp8", lm_head_dtype="fp8")
    assert fp8_head == "H200 / Qwen3.6-35B-A3B FP8 (lm_head FP8)"


def _serve(url: str, out: Path, *extra: str) -> int:
    return main(["bench", "serve", "--base-url", url, "--input-len", "4", "--output-len", "2",
                 "--num-prompts", "2", "--max-concurrency", "2", "--ignore-eos", "--json", str(out), *extra])


FAST = dict(ttft_ms=1.0, itl_ms=1.0)


@pytest.mark.parametrize("fake_server", [Behaviour(**FAST, card={"device": "cuda:0 (NVIDIA H200)"})],
                         indirect=True)
def test_serve_rows_name_the_gpu_and_model(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    assert _serve(fake_server.url, tmp_path / "r.json", "--dtype", "fp8") == 0
    out = capsys.readouterr().out
    assert "Roofline H200 / Qwen3.6-35B-A3B FP8 (server: cuda:0 (NVIDIA H200))" in out
    title = out.index("Roofline H200")
    assert title < out.index("Decode ceiling, c=2 (tok/s):") < out.index("Prefill floor / mean TTFT")
    roof = json.loads((tmp_path / "r.json").read_text())["roofline"]
    assert roof["assumes"] == "H200 / Qwen3.6-35B-A3B FP8" and roof["decode_ceiling_tok_s"] > 0
    assert "omitted" not in roof


@pytest.mark.parametrize(
    ("fake_server", "says"),
    [
        (Behaviour(**FAST, card={"device": "cpu", "vocab_size": 248320}), "the server runs on the CPU"),
        (Behaviour(**FAST, card={"device": "cuda:0", "vocab_size": 4096}),
         "the served model has vocab_size 4096, not 248320: it is not Qwen3.6-35B-A3B"),
        (Behaviour(**FAST, card={"num_hidden_layers": 4}), "num_hidden_layers 4, not 40"),
    ],
    indirect=["fake_server"],
)
def test_serve_rows_omitted_with_one_line(fake_server: FakeServer, says: str, tmp_path: Path, capsys) -> None:
    assert _serve(fake_server.url, tmp_path / "r.json") == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if "oofline" in x]
    assert len(lines) == 1 and lines[0].startswith("Roofline omitted: ") and says in lines[0], out
    assert "ceiling" not in out and "Prefill floor" not in out
    assert "Successful requests:" in out  # the rest of the table is there
    roof = json.loads((tmp_path / "r.json").read_text())["roofline"]
    assert says in roof["omitted"] and "decode_ceiling_tok_s" not in roof

    rep = tmp_path / "rep"
    assert main(["bench", "report", str(tmp_path / "r.json"), "--out", str(rep)]) == 0
    md = (rep / "report.md").read_text()
    assert "| — |" in md and "Roofline omitted for server / " in md and says in md


@pytest.mark.parametrize("fake_server", [Behaviour(**FAST, card={"vocab_size": 4096})], indirect=True)
def test_serve_config_names_the_served_model(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "m" / "config.json"
    cfg.parent.mkdir()
    raw = json.loads(FULL_CONFIG.read_text())
    (raw.get("text_config") or raw)["vocab_size"] = 4096
    cfg.write_text(json.dumps(raw))
    assert _serve(fake_server.url, tmp_path / "r.json", "--config", str(cfg)) == 0
    assert "Roofline H200 / m BF16" in capsys.readouterr().out


def test_offline_rows_omitted_on_the_cpu() -> None:
    cfg = OfflineConfig(input_len=4, output_len=3, batch_size=1, num_iters=1, warmup=0, device="cpu")
    obj, text, _ = _run(cfg, FakeLLM())
    assert "Roofline omitted: a CPU run, and the roofline assumes H200" in text
    assert "ceiling" not in text and "Prefill floor" not in text
    assert obj["roofline"]["omitted"] and obj["roofline"]["assumes"] == "H200 / stdlib BF16"


def test_offline_rows_titled_on_a_gpu() -> None:
    cfg = OfflineConfig(model=f"dummy:{FULL_CONFIG}", input_len=4, output_len=3, batch_size=1, num_iters=1,
                        warmup=0, device="cuda", dtype="fp8")
    obj, text, _ = _run(cfg, FakeLLM())
    assert "Roofline H200 / Qwen3.6-35B-A3B FP8" in text
    assert text.index("Roofline H200") < text.index("Decode ceiling, c=1 (tok/s):")
    assert obj["roofline"]["assumes"] == "H200 / Qwen3.6-35B-A3B FP8"


def test_report_column_names_what_it_assumes(tmp_path: Path) -> None:
    from metainfer.bench.report import markdown, to_row

    def result(workload: str, assumes: str) -> dict:
        return {"kind": "offline", "engine": "e", "workload": workload, "config": {}, "metrics": {},
                "roofline": {"assumes": assumes, "decode_pct_of_ceiling": 12.5}}

    one = markdown([to_row(result("a", "H200 / X FP8")), to_row(result("b", "H200 / X FP8"))], None)
    assert "| % roofline H200 / X FP8 |" in one and "| 12.5 |" in one
    two = markdown([to_row(result("a", "H200 / X FP8")), to_row(result("b", "H200 / Y BF16"))], None)
    assert "| % roofline |" in two and "| 12.5 (H200 / Y BF16) |" in two
