"""Tool calls and reasoning with the official `openai` client, on a server whose engine emits a
scripted text token by token: round trips streamed and not, parallel calls, a forced named call,
the history rendered back, the reasoning split on and off, and unsupported fields refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, LiveServer, live_server
from tests.server.scripted import ScriptedEngine

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
REASONING = "The user wants the weather.\nI will call the tool."


def call(name: str, **args: Any) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


ONE_CALL = f"{REASONING}\n</think>\n\nLet me check.\n\n{call('get_weather', city='Paris', days=3)}"
TWO_CALLS = f"{REASONING}\n</think>\n\n{call('get_weather', city='Paris')}\n{call('get_time')}"
ANSWER = "It is sunny.\n</think>\n\nSunny in Paris, 21 °C."


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[LiveServer, ScriptedEngine]]:
    engine = ScriptedEngine()
    with live_server(engine) as live:
        yield live, engine


@pytest.fixture(scope="module")
def client(scripted: tuple[LiveServer, ScriptedEngine]) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=scripted[0].v1, api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture
def engine(scripted: tuple[LiveServer, ScriptedEngine]) -> ScriptedEngine:
    e = scripted[1]
    e.scripts, e.tokens_per_step = ["Hello."], 1
    return e


def assemble(chunks: list[Any]) -> dict[str, Any]:
    """A streamed choice 0 put together: reasoning, content, tool calls, finish reason; checks the
    OpenAI fragment shape on the way."""
    reasoning, content, calls, finish = "", "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        d = ch.delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        assert (getattr(d, "reasoning", None) or "") == (getattr(d, "reasoning_content", None) or "")
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                assert tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = ch.finish_reason or finish
    assert "<tool_call>" not in content and "</think>" not in content and "<function=" not in content
    return {
        "reasoning": reasoning or None,
        "content": content or None,
        "calls": [(c["name"], json.loads(c["arguments"])) for c in calls.values()],
        "finish": finish,
    }


def whole(r: Any, i: int = 0) -> dict[str, Any]:
    m = r.choices[i].message
    assert m.reasoning == m.reasoning_content
    for tc in m.tool_calls or []:
        assert tc.id.startswith("call_") and tc.type == "function"
    return {
        "reasoning": m.reasoning_content,
        "content": m.content,
        "calls": [(tc.function.name, json.loads(tc.function.arguments)) for tc in m.tool_calls or []],
        "finish": r.choices[i].finish_reason,
    }


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_tool_call_stream_and_not(
    client: openai.OpenAI, engine: ScriptedEngine, tokens_per_step: int
) -> None:
    engine.scripts, engine.tokens_per_step = [ONE_CALL], tokens_per_step
    expected = {
        "reasoning": REASONING,
        "content": "Let me check.",
        "calls": [("get_weather", {"city": "Paris", "days": 3})],
        "finish": "tool_calls",
    }
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS)
    assert whole(r) == expected
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, stream=True))
    assert assemble(chunks) == expected


def test_parallel_calls_and_n(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.scripts = [TWO_CALLS, ONE_CALL]
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, n=2)
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert whole(r, 0)["calls"] == calls and whole(r, 0)["content"] is None
    assert whole(r, 1)["calls"] == [("get_weather", {"city": "Paris", "days": 3})]
    ids = [tc.id for c in r.choices for tc in c.message.tool_calls]
    assert len(set(ids)) == 3
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, stream=True))
    assert assemble(chunks)["calls"] == calls
    single = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, tools=TOOLS, parallel_tool_calls=False
    )
    assert whole(single)["calls"] == calls[:1] and whole(single)["finish"] == "tool_calls"


def test_forced_named_call_and_tool_choice_checks(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.scripts = [ONE_CALL]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice=named)
    assert whole(r)["calls"] == [("get_weather", {"city": "Paris", "days": 3})]
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="required")
    assert whole(r)["finish"] == "tool_calls"
    for kw, param in [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": named}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval"}]}, None),
        ({"tool_choice": "sometimes", "tools": TOOLS}, None),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=USER, **kw)
        if param is not None:
            assert e.value.body["param"] == param, e.value.body


def test_tool_choice_none_leaves_markup_in_content(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.scripts = [ONE_CALL]
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="none")
    m = r.choices[0].message
    assert not m.tool_calls and "<tool_call>" in m.content and r.choices[0].finish_reason == "stop"


def test_round_trip_renders_the_history(
    client: openai.OpenAI, engine: ScriptedEngine, scripted: tuple[LiveServer, ScriptedEngine]
) -> None:
    engine.scripts = [TWO_CALLS]
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, *USER]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS)
    msg = first.choices[0].message
    messages.append(msg)  # the response message itself, as agent loops pass it back
    for tc, result in zip(msg.tool_calls, ["Sunny, 21 °C", "12:00"]):
        messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
    engine.scripts = [ANSWER]
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS)
    assert whole(second) == {
        "reasoning": "It is sunny.",
        "content": "Sunny in Paris, 21 °C.",
        "calls": [],
        "finish": "stop",
    }
    prompt = engine.prompts[-1]
    assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:")
    assert '{"type": "function", "function": {"name": "get_weather"' in prompt
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>" in prompt
    assert (
        f"<|im_start|>assistant\n<think>\n{REASONING}\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nSunny, 21 °C\n</tool_response>\n<tool_response>\n12:00\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    ) in prompt
    tok = httpx.post(
        scripted[0].base_url + "/tokenize",
        json={"messages": [m if isinstance(m, dict) else m.model_dump() for m in messages], "tools": TOOLS},
    ).json()
    assert tok["count"] == len(engine.tokenizer.encode(prompt))


def test_reasoning_split_on_and_off(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.scripts = ["Let me think.\n</think>\n\nFour."]
    on = client.chat.completions.create(model=MODEL_NAME, messages=USER)
    assert whole(on) == {"reasoning": "Let me think.", "content": "Four.", "calls": [], "finish": "stop"}
    assert assemble(
        list(client.chat.completions.create(model=MODEL_NAME, messages=USER, stream=True))
    ) == whole(on)
    off_kw = {"chat_template_kwargs": {"enable_thinking": False}}
    off = client.chat.completions.create(model=MODEL_NAME, messages=USER, extra_body=off_kw)
    assert off.choices[0].message.content == engine.scripts[0] and off.choices[0].message.reasoning is None
    assert engine.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    hidden = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, extra_body={"include_reasoning": False}
    )
    assert whole(hidden)["reasoning"] is None and whole(hidden)["content"] == "Four."
    engine.scripts = ["<think>Opened by the model.</think>Done."]
    again = client.chat.completions.create(model=MODEL_NAME, messages=USER)
    assert (whole(again)["reasoning"], whole(again)["content"]) == ("Opened by the model.", "Done.")
    engine.scripts = ["Cut off while thinking"]
    cut = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=3)
    assert whole(cut)["content"] is None and whole(cut)["finish"] == "length"


def test_malformed_markup_is_content(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    bad = "</think>\n\nSee <tool_call>\n<function=x y\n</tool_call> and <tool_call>{no}</tool_call>"
    engine.scripts = [bad]
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS)
    content = bad.removeprefix("</think>\n\n")
    assert whole(r) == {"reasoning": None, "content": content, "calls": [], "finish": "stop"}
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, stream=True))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == content and finish == ["stop"]


def test_unsupported_fields_are_named(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    for extra, names in [
        ({"reasoning_effort": "low", "web_search_options": {"x": 1}},
         ["reasoning_effort", "web_search_options"]),
        ({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, ["messages[0].audio"]),
        ({"stream_options": {"include_usage": True, "foo": 1}}, ["stream_options.foo"]),
        ({"use_beam_search": True}, ["use_beam_search"]),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=USER, extra_body=extra)
        msg = e.value.body["message"]
        assert all(n in msg for n in names) and e.value.body["param"] == names[0], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="x", extra_body={"reasoning_effort": "low"})
    assert e.value.body["param"] == "reasoning_effort"
    harmless = {
        "store": False,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "functions": None,
        "use_beam_search": False,
        "messages": [{"role": "user", "content": "x", "refusal": None, "annotations": []}],
    }
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, extra_body=harmless)
    assert r.choices[0].finish_reason == "stop"
