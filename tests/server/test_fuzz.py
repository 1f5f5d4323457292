"""Schema fuzz: ~100 hypothesis-generated bodies (mostly near-valid, some junk) across every POST
endpoint; the server never answers 5xx, errors are OpenAI-shaped, and it stays healthy."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL_NAME, LiveServer

CHARS = st.characters() | st.characters(codec=None, categories=["Cs"])  # lone surrogates too


def text(min_size: int = 0, max_size: int = 40) -> st.SearchStrategy[str]:
    return st.text(CHARS, min_size=min_size, max_size=max_size)


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
SOME_JUNK = JUNK.filter(lambda v: v is not None)


TOKEN_IDS = st.lists(st.integers(0, 248_000), min_size=1, max_size=6)
TOOL = st.sampled_from(
    [
        {"type": "function", "function": {"name": "f"}},
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    ]
)
TOOL_CALL = st.fixed_dictionaries(
    {
        "function": st.fixed_dictionaries(
            {"name": text(1, 6), "arguments": st.just('{"a": 1}') | text(max_size=8)}
        )
    },
    optional={"id": text(max_size=6), "type": st.just("function")},
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
    optional={
        "content": text(max_size=40)
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text(max_size=10)}), max_size=2),
        "name": text(max_size=5),
        "tool_calls": st.lists(TOOL_CALL, max_size=2) | JUNK,
        "tool_call_id": text(max_size=5),
        "reasoning_content": text(max_size=10),
    },
)
BAD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["wizard", "", "USER"]) | SOME_JUNK},
    optional={"content": st.lists(st.fixed_dictionaries({"type": st.just("image_url")}), min_size=1) | JUNK},
)
# field -> (valid values, invalid values); bodies are valid, then `mutated` breaks up to two fields
SAMPLING = {
    "model": (st.sampled_from([MODEL_NAME, "alias"]), st.sampled_from(["missing-model", "bad\ud800"])),
    "temperature": (st.floats(0.0, 2.0), st.floats(-10.0, -1e-9)),
    "top_p": (st.floats(0.01, 1.0), st.sampled_from([0.0, 1.5, -1.0])),
    "top_k": (st.integers(-1, 300_000), st.integers(max_value=-2)),
    "min_p": (st.floats(0.0, 1.0), st.floats(1.01, 5.0)),
    "seed": (st.integers(-(2**63), 2**64 - 4), st.sampled_from([2**64, -(2**63) - 1, 10**30])),
    "stop": (
        text(1, 4) | st.lists(text(1, 4), max_size=3),
        st.just("") | st.lists(st.just(""), min_size=1),
    ),
    "stop_token_ids": (TOKEN_IDS, st.lists(st.integers(-5, -1) | st.integers(248_320, 10**12), min_size=1)),
    "ignore_eos": (st.booleans(), SOME_JUNK),
    "n": (st.integers(1, 3), st.sampled_from([0, -1, 129, 10**9])),
    "min_tokens": (st.integers(0, 1), st.integers(max_value=-1) | st.integers(5, 100)),
    "stream": (st.booleans(), SOME_JUNK),
    "stream_options": (
        st.fixed_dictionaries(
            {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
        ),
        SOME_JUNK,
    ),
    "presence_penalty": (st.just(0.0), st.floats(0.1, 2.0)),
    "logit_bias": (
        st.dictionaries(st.integers(0, 248_319).map(str), st.floats(-300.0, 300.0), max_size=3),
        st.dictionaries(text(1, 4) | st.integers(248_320, 10**12).map(str), st.floats(-1, 1), min_size=1),
    ),
    "skip_special_tokens": (st.booleans(), SOME_JUNK),
    "include_stop_str_in_output": (st.booleans(), SOME_JUNK),
    "return_tokens_as_token_ids": (st.booleans(), SOME_JUNK),
    "unknown_field": (JUNK, JUNK),
}
MAX_TOKENS = (st.integers(1, 4), st.sampled_from([0, -1, 10**6, 10**18]))
COMPLETION_FIELDS = {
    **SAMPLING,
    "prompt": (
        text(1, 40)
        | TOKEN_IDS
        | st.lists(text(1, 10), min_size=1, max_size=3)
        | st.lists(TOKEN_IDS, min_size=1, max_size=2),
        st.just("")
        | st.just([])
        | st.lists(st.integers(-5, -1) | st.integers(248_320, 10**12), min_size=1)
        | st.just("word " * 600),
    ),
    "max_tokens": MAX_TOKENS,
    "logprobs": (st.integers(0, 5), st.integers(21, 100) | st.integers(max_value=-1)),
    "echo": (st.booleans(), SOME_JUNK),
    "suffix": (st.none(), text(1)),
}
CHAT_FIELDS = {
    **SAMPLING,
    "messages": (st.lists(MESSAGE, min_size=1, max_size=3), st.just([]) | st.lists(BAD_MESSAGE, min_size=1)),
    "max_tokens": MAX_TOKENS,
    "max_completion_tokens": MAX_TOKENS,
    "logprobs": (st.booleans(), SOME_JUNK),
    "top_logprobs": (st.integers(0, 5), st.integers(21, 100) | st.integers(max_value=-1)),
    "add_generation_prompt": (st.booleans(), SOME_JUNK),
    "chat_template_kwargs": (
        st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()}),
        SOME_JUNK,
    ),
    "tools": (st.lists(TOOL, min_size=1, max_size=2), st.lists(JUNK, min_size=1, max_size=2)),
    "tool_choice": (
        st.sampled_from(["auto", "none", {"type": "function", "function": {"name": "f"}}]),
        st.sampled_from(["required", {"type": "function", "function": {"name": "g"}}]) | JUNK,
    ),
    "parallel_tool_calls": (st.booleans(), SOME_JUNK),
    "include_reasoning": (st.booleans(), SOME_JUNK),
}
TOKENIZE_FIELDS = {
    "prompt": (text(max_size=30), SOME_JUNK),
    "messages": (st.lists(MESSAGE, min_size=1, max_size=2), st.just([]) | st.lists(BAD_MESSAGE, min_size=1)),
    "model": SAMPLING["model"],
    "return_token_strs": (st.booleans(), SOME_JUNK),
}
DETOKENIZE_FIELDS = {"tokens": (TOKEN_IDS, SOME_JUNK), "model": SAMPLING["model"]}


@st.composite
def mutated(draw: st.DrawFn, fields: dict, required: tuple[str, ...], not_null: tuple[str, ...] = ()) -> dict:
    """A valid body, then up to two fields replaced by an invalid value or arbitrary JSON."""
    optional = {k: v for k, (v, _) in fields.items() if k not in required}
    body = draw(st.fixed_dictionaries({k: fields[k][0] for k in required}, optional=optional))
    for key in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)):
        junk = SOME_JUNK if key in not_null else JUNK
        body[key] = draw(fields[key][1] | junk)
    return body


COMPLETION = mutated(COMPLETION_FIELDS, ("prompt",))
CHAT = mutated(CHAT_FIELDS, ("messages", "max_tokens"), not_null=("max_tokens", "max_completion_tokens"))
TOKENIZE = st.one_of(mutated(TOKENIZE_FIELDS, ("prompt",)), mutated(TOKENIZE_FIELDS, ("messages",)))
DETOKENIZE = mutated(DETOKENIZE_FIELDS, ("tokens",))
REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), COMPLETION),
    st.tuples(st.just("/v1/chat/completions"), CHAT),
    st.tuples(st.just("/v1/completions"), COMPLETION.map(lambda b: {**b, "stream": True})),
    st.tuples(st.just("/v1/chat/completions"), CHAT.map(lambda b: {**b, "stream": True})),
    st.tuples(st.just("/tokenize"), TOKENIZE),
    st.tuples(st.just("/detokenize"), DETOKENIZE),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]), JUNK),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.binary(max_size=40)),
)


def check(r: httpx.Response, stream: bool) -> None:
    event(f"{r.request.url.path} -> {r.status_code}{' stream' if stream else ''}")
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["code"] == r.status_code
        return
    if not stream:
        assert isinstance(r.json(), dict)
        return
    events = [line for line in r.text.splitlines() if line]
    assert events and events[-1] == "data: [DONE]", events[-3:]
    for e in events[:-1]:
        assert "error" not in json.loads(e[len("data: ") :]), e


@pytest.mark.timeout(300)
@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(req=REQUESTS)
def test_fuzzed_requests_never_5xx(server: LiveServer, req: tuple[str, object]) -> None:
    path, body = req
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
            check(r, False)
            return
        r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        check(r, r.headers.get("content-type", "").startswith("text/event-stream"))


def test_healthy_after_fuzz(server: LiveServer, http: httpx.Client) -> None:
    server.wait_idle(timeout=60)
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    text = http.get("/metrics").text
    assert 'metainfer:requests_total{model_name="qwen-test",outcome="error"} 0.0' in text
