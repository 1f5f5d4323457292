"""Bad requests get a clear error; the engine keeps serving the others."""

from __future__ import annotations

import pytest

from metainfer.engine.engine import RequestError
from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(logprobs=99), "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_rejected_and_engine_keeps_serving(llm):
    eng = llm.engine
    ok = eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(RequestError, match="empty"):
        eng.add_request("", SamplingParams())
    with pytest.raises(RequestError, match="out of vocabulary"):
        eng.add_request([5, eng.model_config.vocab_size], SamplingParams())
    with pytest.raises(RequestError, match="out of vocabulary"):
        eng.add_request([-1], SamplingParams())
    with pytest.raises(RequestError, match="maximum context length"):
        eng.add_request(list(range(100)), SamplingParams())
    with pytest.raises(RequestError, match="maximum context length"):
        eng.add_request(list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="integers"):
        eng.add_request(["a", "b"], SamplingParams())
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request([1], SamplingParams(), request_id=ok)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert len(done[ok].token_ids) == 4 and done[ok].finish_reason == "length"
    assert eng.cache.usage()["kv_blocks_used"] == 0


def test_abort_frees_cache(llm):
    eng = llm.engine
    a = eng.add_request([1, 2, 3, 4], SamplingParams(max_tokens=50, ignore_eos=True))
    b = eng.add_request([7, 8], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0))
    eng.step()
    out = eng.abort_request(a)
    assert out.finished and out.finish_reason == "abort"
    assert eng.abort_request(a) is None
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            finished[o.request_id] = o
    assert a not in finished and len(finished[b].token_ids) == 5
    assert eng.cache.usage()["kv_blocks_used"] == 0 and eng.cache.usage()["state_slots_used"] == 0


def test_failed_step_fails_only_its_requests(llm, monkeypatch):
    eng = llm.engine
    rid = eng.add_request([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    real = eng.runner.launch

    def boom(batch):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(eng.runner, "launch", boom)
    outs = eng.step()
    assert outs[0].request_id == rid and outs[0].finish_reason == "error" and "injected" in outs[0].error
    monkeypatch.setattr(eng.runner, "launch", real)
    res = llm.generate(
        prompt_token_ids=[[3, 4]], sampling_params=SamplingParams(max_tokens=2, ignore_eos=True)
    )
    assert len(res[0].token_ids) == 2
    assert eng.cache.usage()["kv_blocks_used"] == 0
