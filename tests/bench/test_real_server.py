"""`bench serve` against our own server (`metainfer serve`, default tiny model, CPU)."""

from __future__ import annotations

import asyncio
import json
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from metainfer.bench.client import wait_for_health
from metainfer.bench.compare import ServerProcess, free_port
from metainfer.cli import main

pytestmark = pytest.mark.skipif(
    find_spec("metainfer.server.cli") is None,
    reason="metainfer.server.cli is not importable yet (the server is being written)",
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_short_run_against_metainfer_serve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    server = ServerProcess(
        [sys.executable, "-m", "metainfer.cli", "serve", "--port", str(port), "--device", "cpu"],
        tmp_path / "server.log",
        env={"OMP_NUM_THREADS": "1"},  # small ops: a second thread on shared cores only waits
    )
    try:
        url = f"http://127.0.0.1:{port}"
        if not asyncio.run(wait_for_health(url, 120.0, server.alive)):
            pytest.fail(f"server not healthy within 120 s:\n{server.log_tail()}")
        # out of the box: no --vocab-limit, no --tokenizer (the served vocabulary comes from /v1/models)
        from metainfer.bench.client import served_model_card
        from metainfer.config import DEFAULT_MODEL_DIR, ModelConfig

        card = asyncio.run(served_model_card(url))
        default = ModelConfig.from_hf(DEFAULT_MODEL_DIR / "config.json")
        assert card["vocab_size"] == default.vocab_size and card["device"] == "cpu"
        assert card["num_hidden_layers"] == default.num_hidden_layers
        out = tmp_path / "r.json"
        from metainfer.bench.client import served_model_name

        name = asyncio.run(served_model_name(url)) or "default"
        rc = main(
            [
                "bench",
                "serve",
                "--base-url",
                url,
                "--model",
                name,
                "--input-len",
                "8",
                "--output-len",
                "8",
                "--num-prompts",
                "4",
                "--max-concurrency",
                "2",
                "--ignore-eos",
                "--json",
                str(out),
            ]
        )
        obj = json.loads(out.read_text())
        m = obj["metrics"]
        assert rc == 0, obj["summary"]["errors"]
        # a roofline of an H200 says nothing of a CPU server: one line says so, and no figures
        printed = capsys.readouterr().out
        assert "Roofline omitted: the server runs on the CPU" in printed and "ceiling" not in printed
        assert "omitted" in obj["roofline"] and "decode_ceiling_tok_s" not in obj["roofline"]
        assert m["completed"] == 4 and m["failed"] == 0 and m["num_short_outputs"] == 0
        assert m["total_output_tokens"] == 32 and m["total_input_tokens"] == 32
        for r in obj["requests"]:
            assert r["output_tokens"] == 8 and r["usage_prompt_tokens"] in (None, 8)
            assert r["num_chunks"] <= 8
        assert m["usage_missing"] == 0, "the server should send usage with stream_options.include_usage"
        # the server's own TTFT (engine arrival -> first token, from /metrics) lies inside the client's
        server_ttft = m["server_mean_ttft_ms"]
        assert 0 < server_ttft <= m["mean_ttft_ms"], (server_ttft, m["mean_ttft_ms"])
    finally:
        server.stop()
