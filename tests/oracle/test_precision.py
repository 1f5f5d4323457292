"""Precision mutants: errors that hide under a fixed low-precision allowance must fail the
noise-relative gates (the engine's error over the reference's own at that precision) and the
layer-by-layer check, which names the layer the error enters.

The proxy has the full model's shape where it matters for rounding (top-8 of many experts, full
attention every fourth layer, the dummy recipe), small enough for two CPU cores. Each mutant is a
planted engine bug (monkeypatched for one test); the oracle is never touched. Each test prints the
margin: the figure and its gate.
"""

from __future__ import annotations

import pytest
import torch

from tests.oracle.oracle_helpers import verify

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

PROXY = dict(hidden_size=64, num_hidden_layers=12, num_experts=64, num_experts_per_tok=8,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, vocab_size=512)
MOE_LAYER = 6  # the layer whose experts' output the rounding mutant damages


@pytest.fixture(scope="module")
def proxy_bf16(tmp_path_factory):
    from metainfer.oracle.build import build_setup
    from tests.helpers import write_config

    cfg = write_config(tmp_path_factory.mktemp("proxy12"), **PROXY)
    return build_setup(f"dummy:{cfg}", "quick", {"device": "cpu", "dtype": "bfloat16"})


def _margins(v) -> str:
    f = v.figures
    pre, dec = f["prefill"]["noise"], f["decode"]["noise"]
    return (
        f"rel. RMSE ratio prefill {pre['rel_rmse_ratio']:.2f} decode {dec['rel_rmse_ratio']:.2f}, "
        f"KL ratio {pre['kl_mean_ratio']:.2f} / {dec['kl_mean_ratio']:.2f} "
        f"(gates {v.gates['noise_ratio_rmse']}, {v.gates['noise_ratio_kl']}); "
        f"worst layer ratio {max(f['layers']['ratio']):.2f} "
        f"(gate {v.gates['layer_ratio']}), first layer over: {f['layers']['first_layer_over']}"
    )


def test_honest_bf16_engine_passes_the_noise_gates(proxy_bf16):
    v = verify(proxy_bf16)
    print("honest:", _margins(v))
    assert v.passed, v.failed
    assert v.figures["layers"]["first_layer_over"] is None


def test_top7_routing_fails(proxy_bf16):
    """One expert fewer per token in every MoE layer: the logits' noise ratios and every layer."""
    layers = proxy_bf16.llm.engine.runner.model.layers
    for layer in layers:
        layer.mlp.top_k -= 1
    try:
        v = verify(proxy_bf16)
    finally:
        for layer in layers:
            layer.mlp.top_k += 1
    print("top-7 routing:", _margins(v))
    assert {"prefill.noise_rmse", "decode.noise_rmse", "layers.noise_rmse"} <= set(v.failed)


def test_kv_cache_at_16_levels_fails(proxy_bf16, monkeypatch):
    """The attention layers read a KV cache rounded to 4 bits per value (per-row scale): decode rows
    and the first full-attention layer (3) carry it."""
    import metainfer.kernels.ops as ops

    original = ops.paged_attention

    def q16(c: torch.Tensor) -> None:
        a = c.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 7.5
        c.copy_(((c.float() / a).round().clamp(-8, 7) * a).to(c.dtype))

    def rounded(q, k_cache, v_cache, *args, **kwargs):
        q16(k_cache)
        q16(v_cache)
        return original(q, k_cache, v_cache, *args, **kwargs)

    monkeypatch.setattr(ops, "paged_attention", rounded)
    v = verify(proxy_bf16)
    print("KV cache at 16 levels:", _margins(v))
    assert {"decode.noise_rmse", "layers.noise_rmse"} <= set(v.failed)
    assert v.figures["layers"]["first_layer_over"] == 3


def test_one_moe_layer_at_2_mantissa_bits_fails(proxy_bf16, monkeypatch):
    """One layer's experts' output rounded to 2 mantissa bits: under the logits' allowance, caught
    and localised by the layer check."""
    mlp = proxy_bf16.llm.engine.runner.model.layers[MOE_LAYER].mlp
    forward = mlp.forward

    def rounded(*args, **kwargs):
        out = forward(*args, **kwargs)
        m, e = torch.frexp(out.float())
        return torch.ldexp((m * 4).round() / 4, e).to(out.dtype)

    monkeypatch.setattr(mlp, "forward", rounded)
    v = verify(proxy_bf16)
    print("one MoE layer at 2 mantissa bits:", _margins(v))
    assert "layers.noise_rmse" in v.failed
    assert v.figures["layers"]["first_layer_over"] == MOE_LAYER
