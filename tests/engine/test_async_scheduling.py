"""Async scheduling (step N+1 launched before step N's tokens are processed) gives exactly the
outputs of synchronous stepping: greedy and seeded sampling, EOS/stop strings/stop ids/max_tokens,
preemption, aborts; and every cache block and slot is free afterwards."""

from __future__ import annotations

import pytest

from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM
from tests.helpers import save_hf_model, token_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("async_hf")
    save_hf_model(d, seed=2)
    return d


def _run(model_dir, async_scheduling, params, prompts, **kw):
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", async_scheduling=async_scheduling, **kw)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    usage = llm.engine.cache.usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0
    assert not llm.engine.has_unfinished()
    return [(o.token_ids, o.finish_reason, o.stop_reason, o.text) for o in outs], llm


def test_async_equals_sync_mixed_params(model_dir):
    prompts = token_prompts([1, 5, 17, 40, 9, 3])
    params = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.8, top_k=20, seed=3, stop_token_ids=(17, 99, 250)),
        SamplingParams(max_tokens=12, temperature=0.5, top_p=0.9, seed=11),
        SamplingParams(max_tokens=30, temperature=0, min_tokens=2),
    ]
    a, _ = _run(model_dir, True, params, prompts, max_num_batched_tokens=16, max_num_seqs=4)
    b, _ = _run(model_dir, False, params, prompts, max_num_batched_tokens=16, max_num_seqs=4)
    assert a == b
    assert all(-1 not in t for t, *_ in a)


def test_async_equals_sync_under_preemption(model_dir):
    prompts = token_prompts([2, 6, 17, 30, 45, 64], seed=4)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(max_num_batched_tokens=24, block_size=8, num_kv_blocks=16, max_model_len=128, max_num_seqs=6)
    a, llm = _run(model_dir, True, sp, prompts, **kw)
    assert llm.engine.scheduler.num_preemptions > 0
    b, _ = _run(model_dir, False, sp, prompts, **kw)
    assert a == b


def test_abort_while_a_step_is_in_flight(model_dir):
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32")
    eng = llm.engine
    a = eng.add_request([1, 2, 3], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    b = eng.add_request([4, 5], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng._pending is not None
    out = eng.abort_request(a)
    assert out.finish_reason == "abort" and -1 not in out.token_ids
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            assert -1 not in o.token_ids
            done[o.request_id] = o
    assert a not in done and len(done[b].token_ids) == 6
    assert eng.cache.usage()["kv_blocks_used"] == 0 and eng.cache.usage()["state_slots_used"] == 0


def test_stop_in_flight_then_a_synchronous_step(model_dir):
    """A request whose in-flight token stops it is already in the next batch; when that next step
    must run synchronously (a logprobs request joined), the in-flight tokens are processed after the
    launch, as in an async step: before 2026-11-30i they were processed first, the stopped request's
    blocks were freed under the step being launched, and the whole step failed ("internal error")."""
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    res, _ = _run(model_dir, False, sp, [[1, 2, 3]])
    want = res[0][0]
    stop = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(want[5],))
    assert want[5] not in want[:5]
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32")
    eng = llm.engine
    a = eng.add_request([1, 2, 3], stop)
    done = {}
    while len(eng.requests[a].output_token_ids) < 6:  # its stop token launched, not yet processed
        for o in eng.step():
            done[o.request_id] = o
    assert eng._pending is not None and eng.requests[a].output_token_ids[5] == -1
    b = eng.add_request([4, 5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2))
    while eng.has_unfinished():
        for o in eng.step():
            done[o.request_id] = o
    assert done[a].finish_reason == "stop" and done[a].token_ids == want[:6]
    assert done[b].finish_reason == "length" and len(done[b].token_ids) == 3
    assert eng.cache.usage()["kv_blocks_used"] == 0 and eng.cache.usage()["state_slots_used"] == 0
