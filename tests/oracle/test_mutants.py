"""Anti-cheat: engines that are fast because they are wrong must fail `verify`; the honest one passes.

Each mutant is made by monkeypatching engine internals for one test only; the tiny engine and its
reference (fixture `tiny`) are shared.
"""

from __future__ import annotations

import pytest
import torch

from metainfer.engine.cache import CacheManager
from metainfer.engine.engine import LLMEngine
from metainfer.engine.runner import ModelRunner
from metainfer.model.qwen3_5_moe import Qwen3_5MoeModel
from metainfer.oracle.compare import GATES
from tests.oracle.oracle_helpers import verify

pytest.importorskip("transformers")

LOGIT_CHECKS = {
    f"{p}.{c}" for p in ("prefill", "decode") for c in ("rel_rmse", "kl_mean", "kl_max", "top1_clear")
}


def test_honest_engine_passes(tiny):
    v = verify(tiny)
    assert v.passed, v.failed
    assert v.figures["reference"]["entropy_frac"] < 0.5
    assert v.figures["history"]["reference_rel_diff"] > 0.05  # the judge can see history


def test_constant_output(tiny, monkeypatch):
    def constant(self, hidden):
        out = torch.zeros(hidden.shape[0], self.cfg.vocab_size, device=hidden.device)
        out[:, 7] = 10.0
        return out

    monkeypatch.setattr(Qwen3_5MoeModel, "lm_logits", constant)
    v = verify(tiny)
    assert not v.passed
    assert LOGIT_CHECKS <= set(v.failed)
    assert {"greedy.mismatches", "sensitivity.distinct"} <= set(v.failed)


def test_output_independent_of_prompt(tiny, monkeypatch):
    original = LLMEngine.add_request

    def fixed_prompt(self, prompt, *args, **kwargs):
        return original(self, [5] * len(prompt), *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", fixed_prompt)
    v = verify(tiny)
    assert not v.passed
    assert {"prefill.rel_rmse", "prefill.kl_mean", "sensitivity.distinct"} <= set(v.failed)


def test_outputs_swapped_in_batch(tiny, monkeypatch):
    """Two requests get each other's sampled token: every logit is right, the output is not."""
    original = ModelRunner.wait

    def swapping(self, inflight):
        tokens = original(self, inflight)
        if len(tokens) >= 2:
            tokens[0], tokens[1] = tokens[1], tokens[0]
        return tokens

    monkeypatch.setattr(ModelRunner, "wait", swapping)
    v = verify(tiny)
    assert not v.passed
    assert "greedy.mismatches" in v.failed


def test_request_reads_another_requests_cache(tiny, monkeypatch):
    """The third request admitted gets the second's DeltaNet state slot (and so its block table row)."""
    original_assign, original_release = CacheManager.assign_slot, CacheManager.release
    state = {"n": 0, "donor": None, "real": {}}

    def assign(self, req):
        original_assign(self, req)
        state["n"] += 1
        if state["n"] == 2:
            state["donor"] = req
        elif state["n"] == 3 and state["donor"] is not None and state["donor"].state_slot is not None:
            state["real"][req.request_id] = req.state_slot
            req.state_slot = state["donor"].state_slot

    def release(self, req):
        if req.request_id in state["real"]:
            req.state_slot = state["real"].pop(req.request_id)
        original_release(self, req)

    monkeypatch.setattr(CacheManager, "assign_slot", assign)
    monkeypatch.setattr(CacheManager, "release", release)
    v = verify(tiny)
    assert not v.passed
    assert {"prefill.rel_rmse", "decode.rel_rmse"} & set(v.failed)


# bfloat16 (by default) is the harder case: its gates are loose, only the bias check may fail; float32's
# tighter gates fail it too (CI's slow pass)
@pytest.mark.parametrize("precision", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_small_bias_on_one_token(tiny, monkeypatch, precision):
    """+0.5 nats on one token: under the BF16 gates only the bias check can see it."""
    original = Qwen3_5MoeModel.lm_logits  # (under compute_logits and the decode graph's argmax)

    def biased(self, hidden):
        out = original(self, hidden).float()
        out[:, 123] += 0.5
        return out

    monkeypatch.setattr(Qwen3_5MoeModel, "lm_logits", biased)
    v = verify(tiny, GATES[precision])
    assert not v.passed
    assert {"prefill.bias", "decode.bias"} <= set(v.failed)
    if precision == "bfloat16":
        assert not {"prefill.rel_rmse", "prefill.kl_mean", "decode.rel_rmse", "decode.kl_mean"} & set(
            v.failed
        )
        assert v.figures["prefill_bias"]["token"] == 123


def test_logits_depend_on_the_batch(tiny, monkeypatch):
    """Numerics that change with how many rows share the step: alone and batched runs disagree."""
    original = Qwen3_5MoeModel.lm_logits  # (under compute_logits and the decode graph's argmax)

    def batch_dependent(self, hidden):
        out = original(self, hidden).float()
        return out + 1e-3 * (hidden.shape[0] - 1) * out.roll(1, dims=-1)

    monkeypatch.setattr(Qwen3_5MoeModel, "lm_logits", batch_dependent)
    v = verify(tiny)
    assert not v.passed
    assert "batch.rel_rmse" in v.failed
