"""The engine against transformers' Qwen3_5MoeForCausalLM (the reference this project does not
write), float32 on the CPU, on a tiny config with every layer kind."""

from __future__ import annotations

import pytest
import torch

from metainfer.llm import LLM, SamplingParams
from tests.helpers import rel_rmse, save_hf_model, teacher_forced_greedy

pytest.importorskip("transformers")

LOGITS_RMSE = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_hf")
    hf = save_hf_model(d, seed=1)
    return d, hf


def prompts_of(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_logits(hf, ids):
    return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy_gives(hf, prompt, tokens, n):
    """`tokens` are n tokens and transformers' greedy decoding of `prompt` (`teacher_forced_greedy`)."""
    return len(tokens) == n and teacher_forced_greedy(hf, prompt, tokens) == tokens


def test_prefill_logits_chunked(tiny):
    d, hf = tiny
    llm = LLM(model=str(d), device="cpu", dtype="float32", max_num_batched_tokens=16)
    prompts = prompts_of([1, 2, 7, 16, 63, 130])
    for p, got in zip(prompts, llm.score(prompts)):
        ref = hf_logits(hf, p)
        assert got.shape == ref.shape
        assert rel_rmse(got, ref) <= LOGITS_RMSE, len(p)


def test_decode_step_logits(tiny):
    d, hf = tiny
    llm = LLM(model=str(d), device="cpu", dtype="float32", max_num_batched_tokens=32)
    seen: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def hook(owners, logits):
        for (req, _kind, pos), row in zip(owners, logits):
            seen.setdefault(req.request_id, []).append((pos, row.clone()))

    llm.engine.runner.logits_hook = hook
    prompts = prompts_of([3, 9, 41])
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    )
    for p, o in zip(prompts, outs):
        full = p + o.token_ids
        ref = hf_logits(hf, full)
        steps = seen[o.request_id]
        assert len(steps) == 12  # one prefill step + 11 decode steps
        for pos, row in steps:
            assert rel_rmse(row, ref[pos]) <= LOGITS_RMSE, (len(p), pos)


def _greedy_batch(llm, prompts, n):
    return llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    )


def test_greedy_continuous_batching_chunked(tiny):
    d, hf = tiny
    prompts = prompts_of([1, 4, 9, 23, 50, 97], seed=3)
    llm = LLM(model=str(d), device="cpu", dtype="float32", max_num_batched_tokens=8, max_num_seqs=4)
    outs = _greedy_batch(llm, prompts, 32)
    for p, o in zip(prompts, outs):
        assert hf_greedy_gives(hf, p, o.token_ids, 32), len(p)
    _assert_all_free(llm)


def test_greedy_with_preemption(tiny):
    d, hf = tiny
    prompts = prompts_of([2, 6, 17, 30, 45, 64], seed=4)
    # 16 blocks x 8 tokens: the six sequences (up to 96 tokens each) cannot all stay resident
    llm = LLM(
        model=str(d),
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=24,
        block_size=8,
        num_kv_blocks=16,
        max_model_len=128,
        max_num_seqs=6,
    )
    outs = _greedy_batch(llm, prompts, 32)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) > 0
    for p, o in zip(prompts, outs):
        assert hf_greedy_gives(hf, p, o.token_ids, 32), len(p)
    _assert_all_free(llm)


def test_state_slot_shortage_queues(tiny):
    d, hf = tiny
    prompts = prompts_of([5, 11, 3], seed=5)
    llm = LLM(model=str(d), device="cpu", dtype="float32", num_state_slots=1, max_num_seqs=4)
    outs = _greedy_batch(llm, prompts, 6)
    for p, o in zip(prompts, outs):
        assert hf_greedy_gives(hf, p, o.token_ids, 6), len(p)
    _assert_all_free(llm)


def _assert_all_free(llm):
    usage = llm.engine.cache.usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0, usage
    assert not llm.engine.requests and not llm.engine.has_unfinished()
