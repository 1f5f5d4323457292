"""The oracle on CPU: suites, the default model, a HF checkpoint directory, FP8, the JSON verdict."""

from __future__ import annotations

import json

import pytest
import torch

from metainfer.oracle.build import build_setup, fp8_available
from metainfer.oracle.compare import GATES, PathStats, bias_check, row_stats
from metainfer.oracle.report import format_table, write_verdict
from metainfer.oracle.suites import build_suite
from tests.oracle.oracle_helpers import verify

pytest.importorskip("transformers")


def test_suites_are_seeded_and_shaped():
    from metainfer.tokenizer import load_tokenizer

    tok = load_tokenizer()
    quick = build_suite("quick", 248320, tok, seed=0)
    assert quick == build_suite("quick", 248320, tok, seed=0)
    assert quick != build_suite("quick", 248320, tok, seed=1)
    full = build_suite("full", 248320, tok, seed=0)
    lens = sorted(len(p) for p in full.prompts)
    assert lens[0] == 1 and lens[-1] == 32000 and max(lens) > full.chunk_tokens
    assert sum(p.source == "text" for p in full.prompts) == 4
    a, b = (full.prompts[i].token_ids for i in full.twins)
    assert a[len(a) // 2 :] == b[len(b) // 2 :] and a[: len(a) // 2] != b[: len(b) // 2]
    assert 0 < full.late_from < len(full.prompts)
    # the first wave decodes > 120 sequences together, 128 once the late wave joins
    assert len(full.prompts) >= 128 and full.late_from > 120 and max(full.alone) < len(full.prompts)
    assert sum(p.name.startswith("wide-") for p in full.prompts[: full.late_from]) == 115
    small = build_suite("full", 512, tok, max_model_len=300)  # text cannot be tokenised into 512 ids
    assert all(max(p.token_ids) < 512 for p in small.prompts)
    assert max(len(p) for p in small.prompts) + small.gen_tokens < 300
    assert all(p.source != "text" for p in small.prompts)


def test_bias_check_sees_through_noise():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(400, 64, generator=g) * 10
    noisy = ref + 0.3 * torch.randn(400, 64, generator=g)
    ps = PathStats()
    ps.add("p", row_stats(noisy, ref))
    assert bias_check("x", ps, GATES["bfloat16"])[0].passed
    biased = noisy.clone()
    biased[:, 5] += 0.2
    ps = PathStats()
    ps.add("p", row_stats(biased, ref))
    c, fig = bias_check("x", ps, GATES["bfloat16"])
    assert not c.passed and fig["token"] == 5


def test_default_model_quick_passes(tmp_path):
    setup = build_setup("", "quick", {"device": "cpu"})
    # the default model is a checkpoint directory: transformers loads it again itself
    assert setup.precision == "float32" and setup.reference.info.weights == "checkpoint"
    v = verify(setup)
    assert v.passed, format_table(v)
    assert any(p.source == "text" for p in setup.suite.prompts)
    out = json.loads(write_verdict(tmp_path / "v.json", v).read_text())
    assert out["passed"] is True and out["failed"] == []
    assert {c["name"] for c in out["checks"]} >= {
        "prefill.kl_mean",
        "greedy.mismatches",
        "determinism.same_seed",
    }
    for c in out["checks"]:
        assert {"figure", "gate", "passed"} <= set(c)


def test_checkpoint_dir_reference_loads_it_itself(tmp_path):
    from tests.helpers import save_hf_model

    save_hf_model(tmp_path / "hf", seed=3)
    setup = build_setup(str(tmp_path / "hf"), "quick", {"device": "cpu"})
    assert setup.reference.info.weights == "checkpoint"
    v = verify(setup)
    assert v.passed, format_table(v)


needs_fp8 = pytest.mark.skipif(not fp8_available(), reason="metainfer.model.fp8 is not in this build")


@pytest.fixture(scope="module")
def fp8_setup(tiny_config):
    if not fp8_available():
        pytest.skip("metainfer.model.fp8 is not in this build")
    return build_setup(f"dummy:{tiny_config}", "quick", {"device": "cpu", "quantization": "fp8"})


@needs_fp8
def test_fp8_judged_against_bf16_originals(fp8_setup):
    s = fp8_setup
    assert s.precision == "fp8"
    runner = s.llm.engine.runner
    assert runner.model.layers[0].mlp.w_gate_up.dtype == torch.float8_e4m3fn
    ref_experts = s.reference.model.model.layers[0].mlp.experts.gate_up_proj
    assert ref_experts.dtype == torch.float32  # the pre-quantisation tensor, kept alive
    v = verify(s)
    assert v.passed, format_table(v)
    assert v.figures["prefill"]["kl_mean"] > 10 * GATES["float32"].kl_mean  # quantisation is visible


@needs_fp8
def test_fp8_dequant_scale_off_by_two_fails(fp8_setup, monkeypatch):
    from metainfer.kernels import ops

    original = ops.ref_dequant_fp8
    monkeypatch.setattr(
        ops, "ref_dequant_fp8", lambda w, s, dtype, block=128: original(w, s * 2, dtype, block)
    )
    v = verify(fp8_setup)
    assert not v.passed
    assert {"prefill.kl_mean", "decode.kl_mean"} <= set(v.failed)


@needs_fp8
def test_fp8_quantiser_scale_off_by_two_fails(tiny_config, monkeypatch):
    import metainfer.model.fp8 as fp8

    original = fp8.quantize_model_fp8

    def doubled(model, *args, **kwargs):
        n = original(model, *args, **kwargs)
        for _, lin in fp8.fp8_linears(model):
            lin.weight_scale_inv = lin.weight_scale_inv * 2
        for moe in fp8.fp8_moes(model):
            moe.w_gate_up_scale, moe.w_down_scale = moe.w_gate_up_scale * 2, moe.w_down_scale * 2
        return n

    monkeypatch.setattr(fp8, "quantize_model_fp8", doubled)
    setup = build_setup(f"dummy:{tiny_config}", "quick", {"device": "cpu", "quantization": "fp8"})
    v = verify(setup)
    assert not v.passed
    assert {"prefill.kl_mean", "decode.kl_mean"} <= set(v.failed)
