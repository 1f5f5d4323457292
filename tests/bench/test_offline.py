"""`bench offline` timing arithmetic, with a fake engine of known prefill and per-token cost."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from metainfer.bench.offline import OfflineConfig, offline_benchmark
from metainfer.cli import main

PREFILL_S, PER_TOKEN_S = 0.04, 0.01


@dataclass(frozen=True)
class FakeParams:
    max_tokens: int


@dataclass(frozen=True)
class FakeOut:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str = ""
    finish_reason: str = "length"


class FakeLLM:
    """generate() takes PREFILL_S + (max_tokens - 1) * PER_TOKEN_S; optionally returns short outputs."""

    def __init__(self, short_by: int = 0) -> None:
        self.short_by = short_by
        self.calls: list[tuple[int, int]] = []  # (batch, max_tokens)

    def generate(self, prompt_token_ids: list[list[int]], sampling_params: FakeParams) -> list[FakeOut]:
        n = sampling_params.max_tokens
        self.calls.append((len(prompt_token_ids), n))
        time.sleep(PREFILL_S + (n - 1) * PER_TOKEN_S)
        keep = n - self.short_by if n > 1 else n
        return [FakeOut(p, [7] * keep) for p in prompt_token_ids]


def _run(cfg: OfflineConfig, llm: FakeLLM) -> Any:
    return offline_benchmark(cfg, llm_factory=lambda c: llm, sampling=FakeParams)


def test_offline_separates_prefill_and_decode() -> None:
    llm = FakeLLM()
    cfg = OfflineConfig(  # "cuda": the roofline rows are printed (on a CPU run they are omitted)
        model="", input_len=16, output_len=6, batch_size=3, num_iters=2, warmup=1, device="cuda"
    )
    obj, text, m = _run(cfg, llm)
    assert m.prefill_s == pytest.approx(PREFILL_S, rel=0.25)
    assert m.decode_s == pytest.approx(5 * PER_TOKEN_S, rel=0.15)
    assert m.tpot_ms == pytest.approx(1000 * PER_TOKEN_S, rel=0.15)
    assert m.decode_tok_s == pytest.approx(3 / PER_TOKEN_S, rel=0.15)
    assert m.decode_tok_s_per_stream == pytest.approx(1 / PER_TOKEN_S, rel=0.15)
    assert m.output_throughput == pytest.approx(3 * 6 / m.total_s)
    assert not m.short_outputs
    assert llm.calls[:2] == [(3, 1), (3, 6)] and llm.calls[2:] == [(3, 1), (3, 6)] * 2
    assert obj["kind"] == "offline" and obj["metrics"]["max_concurrency"] == 3
    assert obj["roofline"]["decode_ceiling_tok_s"] > 0 and "decode_pct_of_ceiling" in obj["roofline"]
    assert "Decode tok/s per stream:" in text and "Decode % of ceiling:" in text


def test_offline_reports_short_outputs() -> None:
    cfg = OfflineConfig(input_len=4, output_len=4, batch_size=2, num_iters=1, warmup=0, device="cpu")
    _, text, m = _run(cfg, FakeLLM(short_by=1))
    assert m.short_outputs == ((0, 3), (1, 3)) and "Short outputs:" in text


def test_offline_config_validation() -> None:
    with pytest.raises(ValueError):
        OfflineConfig(output_len=1)
    with pytest.raises(ValueError):
        OfflineConfig(dtype="int4")


@pytest.mark.skipif(find_spec("metainfer.llm") is None, reason="metainfer.llm is not importable")
def test_offline_cli_with_the_default_tiny_model_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "off.json"
    rc = main(
        [
            "bench",
            "offline",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--batch-size",
            "2",
            "--num-iters",
            "1",
            "--warmup",
            "0",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    obj = json.loads(out.read_text())
    m = obj["metrics"]
    assert obj["kind"] == "offline" and m["num_short_outputs"] == 0 and m["decode_tok_s"] > 0
    assert m["total_s"] > 0 and m["prefill_s"] > 0 and "offline" in obj["command"]
