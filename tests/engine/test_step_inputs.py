"""`executors.StepInputs`: one step's host inputs, built once for whichever executor runs it: the logits rows
the step reads (owners, and their rows in the flat token order), each sequence's input ids and where a
PENDING last token is read from; and which executor takes which step."""

from __future__ import annotations

from metainfer.engine.executors import PENDING, PrefillExecutor, StepInputs, decode_only
from metainfer.engine.request import Request, SamplingParams


def _req(rid: str, prompt: list[int], out: list[int], computed: int, params: SamplingParams | None = None,
         drafts: list[int] | None = None, score_only: bool = False) -> Request:
    r = Request(rid, prompt, params or SamplingParams(temperature=0.0), 0, 64, (), score_only=score_only,
                output_token_ids=list(out), num_computed_tokens=computed, block_ids=[1, 2], state_slot=1)
    r.draft_token_ids = list(drafts or [])
    return r


def test_owners_rows_tokens_and_pending_sources():
    dec = _req("dec", [5, 6, 7], [8, PENDING], computed=4)  # decodes its pending last token
    ver = _req("ver", [5, 6, 7], [9], computed=3, drafts=[1, 2])  # its last token, then two drafts
    echo_params = SamplingParams(temperature=0.0, prompt_logprobs=1)
    echo = _req("echo", [4, 3, 2, 1], [], computed=1, params=echo_params)  # prompt logprobs still to come
    chunk = _req("chunk", list(range(10, 30)), [], computed=0)  # a prompt's first chunk: no logits row
    last = _req("last", list(range(10, 16)), [], computed=2)  # a prompt's last chunk: samples
    items = [(dec, 1), (ver, 3), (echo, 2), (chunk, 8), (last, 4)]
    inputs = StepInputs.build(items, {"dec": 5})
    assert inputs.owners == [(dec, "sample", 4), (ver, "verify", 3), (ver, "verify", 4), (ver, "verify", 5),
                             (echo, "prompt", 1), (echo, "prompt", 2), (last, "sample", 5)]
    assert inputs.logits_rows() == [0, 1, 2, 3, 4, 5, 17]  # tokens back to back: 1 + 3 + 2 + 8 + 4
    assert [inputs.source(i) for i in range(len(items))] == [5, -1, -1, -1, -1]
    assert inputs.tokens(0) == [0]  # the device reads it from the previous step's token buffer row 5
    assert inputs.tokens(1) == [9, 1, 2] and inputs.tokens(2) == [3, 2]
    assert inputs.tokens(4) == [12, 13, 14, 15]
    assert decode_only(items[:1]) and not decode_only(items[:2])


def test_lone_prefill_supports():
    class Graphs:
        max_tokens = 16

    ex = PrefillExecutor(Graphs())
    last = _req("last", list(range(10, 16)), [], computed=2)
    assert ex.supports(StepInputs.build([(last, 4)], {}))
    assert not ex.supports(StepInputs.build([(last, 4), (last, 4)], {}))  # not alone
    chunk = _req("chunk", list(range(10, 40)), [], computed=0)
    assert not ex.supports(StepInputs.build([(chunk, 16)], {}))  # does not end the prompt
    ver = _req("ver", [5, 6, 7], [9], computed=3, drafts=[1, 2])
    assert ex.supports(StepInputs.build([(ver, 3)], {}))  # a lone verify
    pend = _req("pend", [5, 6, 7], [9, PENDING], computed=4, drafts=[1])
    assert not ex.supports(StepInputs.build([(pend, 2)], {"pend": 0}))  # its last token is still pending
