"""The start-up warmup (ModelRunner.warmup): eager steps on the null state slot and KV block that
compile the kernels serving meets. It runs on CUDA by default; here it is called on the CPU
reference path to check its step shapes and that it leaves the engine's outputs unchanged."""

from __future__ import annotations

from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM
from tests.helpers import token_prompts


def _llm(**kw):
    kw = dict(max_num_batched_tokens=96, max_model_len=256, max_num_seqs=6, **kw)
    return LLM(device="cpu", dtype="float32", **kw)


def test_warmup_steps_fit_the_engine():
    llm = _llm()
    r, e = llm.engine.runner, llm.engine.ecfg
    assert r.warmup_s == 0.0  # CPU: not run at start
    steps = r.warmup_steps()
    assert any(sum(q) == e.max_num_batched_tokens for q, _ in steps)  # the full budget
    assert any(q[0] == 1 and len(q) > 2 for q, _ in steps)  # decodes mixed with prompts
    assert any(n > 1 and ctx > 0 for q, c in steps for n, ctx in zip(q, c))  # a prompt's later chunk
    for q, c in steps:
        assert len(q) == len(c) <= e.max_num_seqs and sum(q) <= e.max_num_batched_tokens
        assert all(a + b <= e.max_model_len for a, b in zip(q, c))
        decodes = [n == 1 for n in q]
        assert decodes == sorted(decodes, reverse=True)  # decodes first, as ForwardMeta wants


def test_warmup_leaves_generations_unchanged():
    prompts = token_prompts([5, 40, 9], seed=3)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = _llm()
    before = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert llm.engine.runner.warmup() >= 0
    after = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert before == after
    usage = llm.engine.cache.usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0
