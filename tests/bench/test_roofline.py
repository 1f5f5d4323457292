"""The roofline model reproduces docs/design.md §3 for the full Qwen3.6-35B-A3B config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metainfer.bench.roofline import (
    decode_ceiling,
    expected_distinct_experts,
    prefill_floor,
    resolve_config_path,
    step_cost,
)
from metainfer.cli import main
from metainfer.config import FULL_CONFIG, ModelConfig


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_hf(FULL_CONFIG)


def test_weights_read_per_token_at_batch_1(cfg: ModelConfig) -> None:
    c = step_cost(cfg, "decode", "bfloat16")
    p = dict(c.params_by_group)
    assert p["deltanet"] == pytest.approx(1.01e9, rel=0.01)
    assert p["attention"] == pytest.approx(0.27e9, rel=0.02)
    assert p["routed_experts"] + p["shared_expert"] == pytest.approx(1.13e9, rel=0.01)
    assert p["lm_head"] == pytest.approx(0.51e9, rel=0.01)
    assert c.weight_params == pytest.approx(2.95e9, rel=0.01)
    state = dict(c.bytes_by_group)["deltanet_state"]
    assert 30 * 32 * 128 * 128 * 4 * 2 == 125_829_120
    assert state == pytest.approx(126e6, rel=0.03)  # + the small conv state


@pytest.mark.parametrize(
    ("dtype", "lm_head", "design"),
    [("bfloat16", None, 720.0), ("fp8", "bfloat16", 1210.0), ("fp8", "fp8", 1430.0)],
)
def test_batch1_decode_ceilings(cfg: ModelConfig, dtype: str, lm_head: str | None, design: float) -> None:
    c = decode_ceiling(cfg, dtype, concurrency=1, context=0, bandwidth=4.3, lm_head_dtype=lm_head)
    assert c.tok_s == pytest.approx(design, rel=0.05)
    assert c.bound == "memory"


def test_concurrency_32_fp8(cfg: ModelConfig) -> None:
    assert expected_distinct_experts(256, 8, 32) == pytest.approx(160, rel=0.03)
    assert expected_distinct_experts(256, 8, 1) == pytest.approx(8.0)
    c = decode_ceiling(cfg, "fp8", concurrency=32, context=1024)
    assert c.cost.experts_per_layer == pytest.approx(163.3, abs=0.1)
    assert c.tok_s == pytest.approx(5000.0, rel=0.05)


def test_prefill_1k_fp8_reads_every_expert(cfg: ModelConfig) -> None:
    p = prefill_floor(cfg, "fp8", 1024)
    assert p.cost.experts_per_layer == pytest.approx(256.0, abs=0.1)
    assert p.cost.total_bytes == pytest.approx(35e9, rel=0.05)
    assert 8e-3 <= p.step_time_s <= 10e-3


def test_bytes_grow_with_context_and_fp8_scales(cfg: ModelConfig) -> None:
    a = step_cost(cfg, "decode", "fp8", 4, 0).total_bytes
    b = step_cost(cfg, "decode", "fp8", 4, 1000).total_bytes
    assert b - a == pytest.approx(4 * 1000 * 10 * 2 * 2 * 256 * 2)  # 20 KiB per token per sequence
    bf, f8 = step_cost(cfg, "decode", "bfloat16"), step_cost(cfg, "decode", "fp8")
    attn_bf, attn_f8 = dict(bf.bytes_by_group)["attention"], dict(f8.bytes_by_group)["attention"]
    assert attn_bf / 2 < attn_f8 < attn_bf / 2 * 1.001  # 1 B/param + fp32 per 128x128 block


def test_resolve_config_path(tmp_path: Path) -> None:
    assert resolve_config_path(None) == FULL_CONFIG
    assert resolve_config_path(f"dummy:{FULL_CONFIG}") == FULL_CONFIG
    (tmp_path / "config.json").write_text(FULL_CONFIG.read_text())
    assert resolve_config_path(str(tmp_path)) == tmp_path / "config.json"
    assert resolve_config_path("served-model-name") == FULL_CONFIG
    with pytest.raises(FileNotFoundError):
        resolve_config_path(str(tmp_path / "nope.json"), strict=True)


def test_roofline_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "roofline",
            "--dtype",
            "fp8",
            "--concurrency",
            "32",
            "--context",
            "1024",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "ceiling:" in text and "floor:" in text and "routed_experts" in text
    obj = json.loads(out.read_text())
    assert obj["kind"] == "roofline" and obj["metrics"]["decode"]["tok_s"] == pytest.approx(5000, rel=0.05)
    assert main(["bench", "roofline", "--model", str(tmp_path / "missing.json")]) == 2


def test_readme_tables_are_current(cfg: ModelConfig) -> None:
    from metainfer.bench.roofline_doc import markdown_tables

    readme = (Path(__file__).resolve().parents[2] / "benchmarks" / "README.md").read_text()
    begin, end = "<!-- roofline-tables:begin -->\n", "<!-- roofline-tables:end -->"
    embedded = readme[readme.index(begin) + len(begin) : readme.index(end)]
    assert embedded == markdown_tables(cfg, 4.3), "regenerate with `metainfer bench roofline --markdown`"


def test_bf16_state_storage_halves_the_state_bytes(cfg: ModelConfig) -> None:
    """--ssm-state-dtype bfloat16 (KB-0046): the decode step's DeltaNet state traffic at 2 bytes per
    element is half the fp32 one (the conv states stay bf16), and the ceiling rises."""
    full = dict(step_cost(cfg, "decode", "fp8", 32, 1040).bytes_by_group)["deltanet_state"]
    half = dict(step_cost(cfg, "decode", "fp8", 32, 1040, state_bytes=2).bytes_by_group)["deltanet_state"]
    conv = 32 * 2 * len(cfg.linear_layer_ids) * cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) * 2
    assert half - conv == pytest.approx((full - conv) / 2)
    faster = decode_ceiling(cfg, "fp8", 32, 1040, state_bytes=2)
    assert faster.tok_s > decode_ceiling(cfg, "fp8", 32, 1040).tok_s
