"""Structured outputs in the engine (the embedded default model on the CPU): the grammar mask in
the sampling step, matchers across preemption (recompute), unconstrained neighbours untouched."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from metainfer.engine.grammar import StructuredSpec, apply_bitmask, bitmask_words
from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "maximum": 99},
                   "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                                       "maxItems": 2}},
    "required": ["name", "n", "ok", "tags"],
}
PROMPTS = ["Hello", "A record:", "The quick brown fox", "JSON please", "x", "Once upon a time there"]


def _params(i: int) -> SamplingParams:
    if i % 2:  # plain, greedy: every token past EOS as well
        return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=48, temperature=1.0 if i % 4 else 0.0, seed=i,
                          structured=StructuredSpec.json_schema(SCHEMA))


def _run(**kw) -> tuple[list[list[int]], list, LLM]:
    llm = LLM(device="cpu", dtype="float32", **kw)
    outs = llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    return [o.token_ids for o in outs], outs, llm


def test_apply_bitmask_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    V = 70
    logits = torch.randn(4, V, generator=g)
    allowed = torch.rand(2, V, generator=g) < 0.3
    bm = torch.zeros(2, bitmask_words(V), dtype=torch.int32)
    for r in range(2):
        for t in range(V):
            if allowed[r, t]:
                w, b = divmod(t, 32)
                bm[r, w] |= torch.tensor(1 << b if b < 31 else -(1 << 31), dtype=torch.int32)
    out = apply_bitmask(logits, torch.tensor([1, 3]), bm)
    want = logits.clone()
    want[1][~allowed[0]] = float("-inf")
    want[3][~allowed[1]] = float("-inf")
    assert torch.equal(out, want)


def test_grammar_survives_preemption_and_leaves_neighbours_alone():
    ample, outs, llm = _run(max_num_batched_tokens=64, max_model_len=128, max_num_seqs=6)
    for i, o in enumerate(outs):
        if i % 2 == 0:
            assert o.finish_reason == "stop", o.text
            jsonschema.validate(json.loads(o.text), SCHEMA)
    tight, touts, tllm = _run(max_num_batched_tokens=24, block_size=8, num_kv_blocks=16, max_model_len=128,
                              max_num_seqs=6)
    assert tllm.engine.scheduler.num_preemptions > 0
    assert any(o.num_preemptions for i, o in enumerate(touts) if i % 2 == 0)  # a constrained one resumed
    assert tight == ample  # resumed matchers took the same tokens (seeded draws ignore the batch)
    # the plain requests' tokens equal their runs alone, where every step may run async
    alone = LLM(device="cpu", dtype="float32", max_model_len=128)
    plain = alone.generate([PROMPTS[1], PROMPTS[3], PROMPTS[5]], [_params(1)] * 3)
    assert [o.token_ids for o in plain] == [ample[1], ample[3], ample[5]]
    assert alone.engine.stats["async_steps"] > 0


def test_constrained_requests_are_not_drafted_and_bad_specs_raise():
    llm = LLM(device="cpu", dtype="float32", max_model_len=128, speculative="ngram")
    out = llm.generate(["{\"a\": 1, \"a\": 1, \"a\": 1"], SamplingParams(
        max_tokens=40, temperature=0.0, structured=StructuredSpec.json_schema(SCHEMA)))[0]
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert llm.engine.stats["spec_drafted"] == 0
    from metainfer.engine.engine import RequestError

    for spec in (StructuredSpec("regex", "a("), StructuredSpec("json", '{"type": "nope"}'),
                 StructuredSpec("grammar", "start: ("), StructuredSpec("choice", "[]")):
        with pytest.raises(RequestError):
            llm.engine.add_request("x", SamplingParams(structured=spec))
    assert not llm.engine.has_unfinished()


def test_after_thinking_frees_the_reasoning_only():
    from metainfer.engine.grammar import GrammarBackend, fill_bitmask
    from metainfer.tokenizer import load_tokenizer

    tok = load_tokenizer("metainfer/assets/stdlib")
    V = 4096
    be = GrammarBackend(tok, V, tok.eos_token_ids)
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                       "required": ["a"]})
    m = be.matcher(StructuredSpec(spec.kind, spec.value, after_thinking=True))
    eos = tok.eos_token_ids[0]

    def allowed(t: int) -> bool:
        bm = fill_bitmask([m], V)
        return bool((int(bm[0, t // 32]) >> (t % 32)) & 1)

    reasoning = tok.encode("Let me think: a is {not json} here.")
    out = list(reasoning)
    m.sync(out)
    assert allowed(tok.encode(" x")[0]) and not allowed(eos)  # free text, no end yet
    out += tok.encode("</think>\n\n")
    m.sync(out)
    assert not m.error and not allowed(eos) and not allowed(tok.encode("x")[0])  # the answer: JSON
    out += tok.encode('{"a":7}')
    m.sync(out)
    assert not m.error and allowed(eos)
    bad = be.matcher(spec)  # without the flag, reasoning text is refused
    bad.sync(reasoning[:1])
    assert bad.error
