"""Structured outputs with the official `openai` client against the live server and the embedded
default model: json_schema / json_object / regex / choice outputs that always parse and validate,
bad constraints -> 400 before anything is queued, forced tool calls that parse, and a constrained
request beside an unconstrained one that the mask leaves unchanged."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL_NAME, LiveServer

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "Describe a person as JSON."}]

SCHEMAS = [
    {  # flat, required fields, an enum, a bounded integer
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0},
                       "role": {"enum": ["admin", "user", "guest"]}},
        "required": ["name", "age", "role"],
    },
    {  # nested object and a bounded array
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                     "minItems": 1, "maxItems": 3},
            "owner": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "number"}},
                      "required": ["ok"]},
        },
        "required": ["id", "tags", "owner"],
    },
    {  # optional fields, an array of enum-valued objects
        "type": "object",
        "properties": {
            "items": {"type": "array", "maxItems": 2, "items": {
                "type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer"}},
                "required": ["k", "v"]}},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["items"],
    },
]


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)
    yield c
    c.close()


def _json_schema_samples(client: openai.OpenAI, n_per_schema: int, n_rounds: int) -> int:
    """n_rounds x len(SCHEMAS) requests of n_per_schema choices (temperature 1, distinct seeds); every
    choice parses and validates. Returns the number of samples checked."""
    checked = 0
    for rnd in range(n_rounds):
        for si, schema in enumerate(SCHEMAS):
            r = client.chat.completions.create(
                model=MODEL_NAME, messages=USER, temperature=1.0, seed=1000 * rnd + 10 * si, n=n_per_schema,
                max_tokens=120,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{si}", "schema": schema,
                                                                        "strict": True}},
                extra_body=NO_THINK,
            )
            for c in r.choices:
                assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
                jsonschema.validate(json.loads(c.message.content), schema)
                checked += 1
    return checked


def test_json_schema_100_samples_validate(client: openai.OpenAI) -> None:
    """~30 s on two shared CPU cores: under the suite's bar for a slow mark."""
    assert _json_schema_samples(client, n_per_schema=9, n_rounds=4) >= 100


def test_json_object_regex_choice_and_vllm_forms(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, temperature=1.0, seed=3,
                                       max_tokens=60, response_format={"type": "json_object"},
                                       extra_body=NO_THINK)
    c = r.choices[0]
    if c.finish_reason == "stop":  # an open object may outgrow max_tokens; a finished one parses
        assert isinstance(json.loads(c.message.content), dict)
    r = client.completions.create(model=MODEL_NAME, prompt="Phone:", temperature=1.0, seed=1, max_tokens=20,
                                  extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text), r.choices[0].text
    options = ["positive", "negative", "neutral"]
    for seed in range(3):
        r = client.completions.create(model=MODEL_NAME, prompt="Sentiment:", temperature=1.0, seed=seed,
                                      max_tokens=10, extra_body={"guided_choice": options})
        assert r.choices[0].text in options and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL_NAME, prompt="x", temperature=1.0, seed=2, max_tokens=30,
                                  extra_body={"structured_outputs": {"json": SCHEMAS[0]}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[0])
    r = client.completions.create(model=MODEL_NAME, prompt="x", temperature=1.0, seed=2, max_tokens=10,
                                  extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL_NAME, prompt="x", temperature=1.0, seed=2, max_tokens=12,
                                  extra_body={"guided_choice": ["yes", "no"], "ignore_eos": True})
    assert r.choices[0].text in ("yes", "no") and r.usage.completion_tokens == 12  # then only EOS


def test_bad_constraints_are_400(client: openai.OpenAI, server: LiveServer) -> None:
    bad = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, None),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a(b"}, None),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: ("}, None),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, None),
        ({"guided_regex": "a+", "min_tokens": 2}, None),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=5,
                                           extra_body={**extra, **NO_THINK})
        if param is not None:
            assert e.value.body["param"] == param, (extra, e.value.body)
    server.wait_idle()  # nothing was queued, nothing leaked


def test_thinking_on_is_accepted(client: openai.OpenAI) -> None:
    """Thinking on (the prompt ends inside <think>): the request is served, its reasoning free text
    (the grammar's split is tested in tests/engine/test_structured.py; the embedded model rarely
    closes its reasoning by chance); a finished answer validates."""
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, temperature=1.0, seed=0, max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}},
    )
    c = r.choices[0]
    assert c.message.reasoning_content
    if c.finish_reason == "stop":
        jsonschema.validate(json.loads(c.message.content), SCHEMAS[0])


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}},
]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_call_parses(client: openai.OpenAI, choice) -> None:
    kw = dict(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=5,
              max_tokens=44, parallel_tool_calls=False, extra_body=NO_THINK)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    for name, args in calls:
        if isinstance(choice, dict):
            assert name == "add"
        jsonschema.validate(json.loads(args), params[name])
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):  # the same seed: the same calls
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            e = streamed.setdefault(d.index, ["", ""])
            e[0] += (d.function.name or "") if d.function else ""
            e[1] += (d.function.arguments or "") if d.function else ""
    assert [(n, json.loads(a)) for n, a in streamed.values()] == [(n, json.loads(a)) for n, a in calls]


def test_unconstrained_neighbour_unchanged(client: openai.OpenAI) -> None:
    """A greedy request without a constraint gives the same tokens alone and beside a constrained one
    in the same batch (n=2 would share nothing: two requests race into the same steps instead)."""
    import concurrent.futures as cf

    def plain():
        return client.completions.create(model=MODEL_NAME, prompt="The sea", temperature=0.0, max_tokens=24,
                                         extra_body={"ignore_eos": True}).choices[0].text

    def constrained():
        return client.completions.create(model=MODEL_NAME, prompt="x", temperature=1.0, seed=1, max_tokens=80,
                                         extra_body={"guided_json": SCHEMAS[0]}).choices[0].text

    alone = plain()
    with cf.ThreadPoolExecutor(2) as ex:
        fc = ex.submit(constrained)
        fp = ex.submit(plain)
        jsonschema.validate(json.loads(fc.result()), SCHEMAS[0])
        assert fp.result() == alone
