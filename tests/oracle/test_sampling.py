"""The oracle's sampling, stop and logprob checks: the restated noise contract equals the engine's
sampler, honest engines pass, and engines with a wrong sampler, stop handling or logprobs fail.

Mutants monkeypatch the engine for one test only; each prints its failing figure against the gate.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import metainfer.engine.runner as runner_mod
from metainfer.engine import sampler
from metainfer.engine.engine import LLMEngine
from metainfer.oracle.build import build_setup
from metainfer.oracle.sampling import Config, configs, noise_uniform, oracle_choice, sampling_checks

pytest.importorskip("transformers")

SEEDS = (0, 1, 12345, 2**32 + 5, 2**63 + 7, 2**64 - 1, -1, -(2**63))


def run(setup):
    checks, figures = sampling_checks(setup.llm, setup.reference, setup.suite, setup.precision)
    return {c.name: c for c in checks}, figures


def failing(setup, name: str) -> dict:
    """Runs the checks, asserts `name` fails, prints its margin."""
    checks, figures = run(setup)
    c = checks[name]
    detail = "; ".join(figures["stops"]["failures"][:2]) if name == "sampling.stops" else c.detail
    print(f"{name}: figure {c.figure} vs gate {c.gate} -> {'PASS' if c.passed else 'FAIL'}; {detail}")
    assert not c.passed
    return figures


def assert_honest(checks: dict, figures: dict) -> None:
    assert checks["sampling.tokens"].passed, checks["sampling.tokens"]
    assert checks["sampling.logprobs"].passed, checks["sampling.logprobs"]
    assert checks["sampling.stops"].passed, figures["stops"]["failures"]


def test_noise_restatement_matches_the_engine():
    V = 1000
    for seed in SEEDS:
        for step in (0, 1, 7, 2**31 + 3):
            sb = sampler.SamplingBatch.build([(1.0, 0, 1.0, 0.0, seed % 2**64, step)], "cpu")
            eng = sampler.uniform_noise(sb.seeds, sb.steps, V)[0].double()
            ours = torch.from_numpy(noise_uniform(seed, step, V))
            assert torch.equal(eng, ours), (seed, step)  # every value exact in fp32
    assert not torch.equal(torch.from_numpy(noise_uniform(1, 0, V)), torch.from_numpy(noise_uniform(1, 1, V)))


def test_noise_never_reaches_one_at_the_full_vocabulary():
    """Over the full model's 248,320 ids a row holds an id whose hash tops the range about once in 70
    rows; its u must stay below 1 (u == 1 is an infinite Gumbel score: that id sampled whatever the
    logits), in the engine's fp32 as in the oracle's float64."""
    V, top = 248320, 0
    for seed in range(200):
        u = sampler.uniform_noise(torch.tensor([seed]), torch.tensor([3]), V)[0]
        assert float(u.max()) < 1.0 and float(u.min()) > 0.0, seed
        assert torch.isfinite(-torch.log(-torch.log(u))).all(), seed
        top += int(float(u.max()) == 1.0 - 2.0**-24)
    assert top >= 1  # the range's top value occurs in these rows: the bound above was exercised


@pytest.mark.parametrize("T, top_k, top_p", [(0.6, 0, 0.9), (1.3, 50, 1.0), (0.6, 0, 1.0)])
def test_oracle_choice_matches_the_engine_sampler_at_the_full_vocabulary(T, top_k, top_p):
    """Seeds from the oracle's own suite (one of them >= 2^63) at 248,320 ids: wherever the oracle calls
    its choice clear, the engine's sampler picks it."""
    g = torch.Generator().manual_seed(1)
    V, judged = 248320, 0
    cfg = Config("full-vocab", T, top_k=top_k, top_p=top_p)
    for i, seed in enumerate([18446744073709334238, *SEEDS[:7]]):
        logits = torch.randn(V, generator=g) * 3
        sb = sampler.SamplingBatch.build([(T, top_k, top_p, 0.0, seed % 2**64, 3)], "cpu")
        eng = int(sampler.sample(logits[None], sb)[0])
        ch = oracle_choice(logits, cfg, seed, 3, 1e-3)
        judged += ch.judged
        if ch.judged:
            assert eng == ch.token, (i, seed, ch)
    assert judged >= 4


@pytest.mark.parametrize("cfg", configs() + [Config("all", 0.8, top_k=4, top_p=0.6, min_p=0.05)])
def test_oracle_choice_matches_the_engine_sampler(cfg):
    """Random logits spread like a peaked model's: where the oracle calls its choice clear, the
    engine's sampler picks the same token; filters change the choice often enough to matter."""
    g = torch.Generator().manual_seed(0)
    B, V = 64, 300
    logits = torch.randn(B, V, generator=g) * 3
    seeds = [SEEDS[i % len(SEEDS)] + i for i in range(B)]
    rows = [(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, s % 2**64, i % 5) for i, s in enumerate(seeds)]
    eng = sampler.sample(logits, sampler.SamplingBatch.build(rows, "cpu")).tolist()
    judged = bites = 0
    for i in range(B):
        ch = oracle_choice(logits[i], cfg, seeds[i], i % 5, 1e-4)
        judged += ch.judged
        bites += ch.judged and ch.bite
        if ch.judged:
            assert eng[i] == ch.token, (i, ch)
    assert judged >= 0.9 * B
    assert bites >= (0 if cfg.name.endswith("none") else 3)


def test_honest_engine_passes(tiny):
    checks, f = run(tiny)
    print({n: (c.figure, c.gate, c.detail) for n, c in checks.items()}, f["timing_s"])
    assert_honest(checks, f)
    judged = {n: x["judged"] for n, x in f["per_config"].items()}
    assert min(judged.values()) >= 20 and f["first_token"]["judged"] == 16
    # every filter changes the choice at some judged position: ignoring it would be seen
    for flt in ("top_k", "top_p", "min_p"):
        assert sum(x["judged_bites"] for n, x in f["per_config"].items() if n.endswith(flt)) > 0, flt
    assert f["stops"]["judged"] >= 4 and isinstance(f["stops"]["stop_string"], dict)
    assert f["stops"]["eos_exercised"] is False  # EOS ids are outside the tiny vocabulary
    assert f["timing_s"]["total"] < 10  # ~1.5 s on one idle core


def test_min_tokens_bans_stop_ids(tiny):
    """vLLM's semantics: no stop id or EOS is generated before min_tokens tokens exist."""
    checks, f = run(tiny)
    assert checks["sampling.stops"].passed, f["stops"]["failures"]


@pytest.fixture(scope="module")
def tiny_bf16(tiny_config):
    return build_setup(f"dummy:{tiny_config}", "quick", {"device": "cpu", "dtype": "bfloat16"})


def test_honest_bfloat16_engine_passes(tiny_bf16):
    assert tiny_bf16.precision == "bfloat16"
    checks, f = run(tiny_bf16)
    print({n: (c.figure, c.gate, c.detail) for n, c in checks.items()}, f["logprobs"])
    assert_honest(checks, f)
    assert f["logprobs"]["mean_abs_err"] > 1e-3  # rounding is visible against the reference ...
    assert f["logprobs"]["self_max_abs_err"] < 1e-4  # ... but not against the engine's own rows


def test_default_model_exercises_eos(monkeypatch):
    """The embedded trained model ends a Python file with <|endoftext|>: EOS is judged, and an
    engine that ignores it fails."""
    setup = build_setup("", "quick", {"device": "cpu"})
    checks, f = run(setup)
    assert_honest(checks, f)
    assert f["stops"]["eos_exercised"] and isinstance(f["stops"]["stop_string"], dict)
    monkeypatch.setattr(LLMEngine, "_check_stop", _without(LLMEngine._check_stop, eos=True))
    failing(setup, "sampling.stops")


# ---- sampler mutants ----------------------------------------------------------------------------


def _patch_sampler(monkeypatch, change) -> None:
    """The runner samples through `change(sb) -> SamplingBatch` (or `change(toks, sb)` on the result)."""
    original = sampler.sample

    def mutant(logits, sb):
        return change(original, logits, sb)

    monkeypatch.setattr(runner_mod, "sample", mutant)


def _only_in(figures: dict, suffix: str) -> None:
    bad = {n: x["mismatches"] for n, x in figures["per_config"].items() if x["mismatches"]}
    assert bad and all(n.endswith(suffix) for n in bad), bad


def test_temperature_multiplies(tiny, monkeypatch):
    def times_t(orig, logits, sb):
        inv = torch.where(sb.temperature > 0, 1 / sb.temperature, sb.temperature)
        return orig(logits, dataclasses.replace(sb, temperature=inv))

    _patch_sampler(monkeypatch, times_t)
    failing(tiny, "sampling.tokens")


@pytest.mark.parametrize("flag", ["top_k", "top_p", "min_p"])
def test_filter_ignored(tiny, monkeypatch, flag):
    off = {f"any_{flag}": False}
    _patch_sampler(monkeypatch, lambda orig, x, sb: orig(x, dataclasses.replace(sb, **off)))
    _only_in(failing(tiny, "sampling.tokens"), flag)


def test_fixed_token_after_the_first(tiny, monkeypatch):
    def fixed(orig, logits, sb):
        return torch.where((sb.steps > 0) & (sb.temperature > 0), 7, orig(logits, sb))

    _patch_sampler(monkeypatch, fixed)
    f = failing(tiny, "sampling.tokens")
    assert f["first_token"]["mismatches"] == 0


def test_noise_step_off_by_one(tiny, monkeypatch):
    _patch_sampler(monkeypatch, lambda orig, x, sb: orig(x, dataclasses.replace(sb, steps=sb.steps + 1)))
    failing(tiny, "sampling.tokens")


# ---- stop mutants -------------------------------------------------------------------------------


def _without(check_stop, stop_ids: bool = False, eos: bool = False):
    def mutant(self, req, tok, n_out):
        params, eos_ids = req.params, req.eos_token_ids
        changes = {"stop_token_ids": ()} if stop_ids else {}
        req.params = dataclasses.replace(params, **changes)
        req.eos_token_ids = () if eos else eos_ids
        try:
            return check_stop(self, req, tok, n_out)
        finally:
            req.params, req.eos_token_ids = params, eos_ids

    return mutant


@pytest.mark.parametrize("what", ["stop_ids", "min_tokens"])
def test_stop_handling_broken(tiny, monkeypatch, what):
    if what == "min_tokens":  # stop ids and EOS not banned before min_tokens (only not stopped on)
        from metainfer.engine.runner import ModelRunner

        monkeypatch.setattr(ModelRunner, "_min_tokens_bans", staticmethod(lambda reqs, vocab: []))
    else:
        monkeypatch.setattr(LLMEngine, "_check_stop", _without(LLMEngine._check_stop, stop_ids=True))
    failing(tiny, "sampling.stops")


def test_stop_string_cut_in_the_wrong_place(tiny, monkeypatch):
    original = LLMEngine._final_text

    def late_cut(req):
        delta = original(req)
        if isinstance(req.stop_reason, str) and req.detokenizer is not None:
            full = req.detokenizer.text
            req.text = full[: len(req.text) + 1]  # one character past the cut
        return delta

    monkeypatch.setattr(LLMEngine, "_final_text", staticmethod(late_cut))
    failing(tiny, "sampling.stops")


# ---- logprob mutants ----------------------------------------------------------------------------


def test_logprobs_offset(tiny, monkeypatch):
    original = sampler.top_logprobs

    def plus(logits, tokens, n):
        chosen, top_v, top_i = original(logits, tokens, n)
        return chosen + 0.1, top_v + 0.1, top_i

    monkeypatch.setattr(runner_mod, "top_logprobs", plus)
    failing(tiny, "sampling.logprobs")


def test_logprobs_after_temperature(tiny, monkeypatch):
    """Logprobs of the tempered distribution (what was sampled from), not of the model's."""
    orig_sample, orig_lp = sampler.sample, sampler.top_logprobs
    seen: dict = {}

    def sample(logits, sb):
        seen["rows"], seen["t"] = logits, torch.where(sb.temperature > 0, sb.temperature, 1.0)
        return orig_sample(logits, sb)

    def tempered(logits, tokens, n):
        t = seen["t"] if seen.get("rows") is logits else torch.ones(logits.shape[0])
        return orig_lp(logits / t[:, None], tokens, n)

    monkeypatch.setattr(runner_mod, "sample", sample)
    monkeypatch.setattr(runner_mod, "top_logprobs", tempered)
    failing(tiny, "sampling.logprobs")
