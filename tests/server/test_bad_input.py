"""Bad input is answered with a 4xx and an OpenAI-style error body, and never breaks the server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, LiveServer

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def cmpl(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 2, **kw}


RAW = [  # (path, raw body, status)
    (CMPL, b'{"prompt": ', 400),
    (CMPL, b"", 400),
    (CMPL, b"[1, 2]", 400),
    (CMPL, b'"a string"', 400),
    (CHAT, b"{'single': 'quotes'}", 400),
    (CHAT, b"\xff\xfe\x00garbage", 400),
    (CMPL, b'{"prompt": "x", "temperature": NaN}', 400),
    (CMPL, b'{"prompt": "x", "logit_bias": {"5": NaN}}', 400),
    ("/tokenize", b"{", 400),
]

JSON = [  # (path, body, status, param)
    (CMPL, {"model": MODEL_NAME}, 400, "prompt"),
    (CHAT, {"model": MODEL_NAME}, 400, "messages"),
    (CMPL, cmpl(model="no-such-model"), 404, "model"),
    (CHAT, chat(model="no-such-model"), 404, "model"),
    (CMPL, cmpl(prompt=5), 400, None),
    (CMPL, cmpl(max_tokens="ten"), 400, "max_tokens"),
    (CMPL, cmpl(temperature="hot"), 400, "temperature"),
    (CMPL, cmpl(n=1.5), 400, "n"),
    (CMPL, cmpl(stop=5), 400, None),
    (CMPL, cmpl(stream="maybe"), 400, "stream"),
    (CHAT, chat(messages="hi"), 400, "messages"),
    (CHAT, chat(messages=[{"content": "no role"}]), 400, None),
    (CMPL, cmpl(prompt="word " * 600), 400, None),
    (CMPL, cmpl(prompt=[1] * 600), 400, None),
    (CHAT, chat(messages=[{"role": "user", "content": "word " * 600}]), 400, None),
    (CMPL, cmpl(max_tokens=600), 400, None),
    (CMPL, cmpl(max_tokens=0), 400, "max_tokens"),
    (CMPL, cmpl(max_tokens=-3), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CMPL, cmpl(temperature=-0.5), 400, "temperature"),
    (CMPL, cmpl(top_p=1.5), 400, "top_p"),
    (CMPL, cmpl(top_p=0), 400, "top_p"),
    (CMPL, cmpl(top_k=-5), 400, "top_k"),
    (CMPL, cmpl(min_p=2), 400, "min_p"),
    (CMPL, cmpl(n=129), 400, "n"),
    (CMPL, cmpl(n=0), 400, "n"),
    (CMPL, cmpl(prompt=["a"] * 20, n=128), 400, "n"),
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), 400, None),
    (CMPL, cmpl(logprobs=21), 400, "logprobs"),
    (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    (CMPL, cmpl(prompt=[-1]), 400, None),
    (CMPL, cmpl(prompt=[10**9]), 400, None),
    (CMPL, cmpl(prompt=""), 400, None),
    (CMPL, cmpl(prompt=[]), 400, "prompt"),
    (CMPL, cmpl(stop_token_ids=[-7]), 400, None),
    (CMPL, cmpl(stop=[""]), 400, None),
    (CMPL, cmpl(seed=2**70), 400, "seed"),
    (CMPL, cmpl(seed=2**64 - 1, n=2), 400, None),
    (CMPL, cmpl(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    (CMPL, cmpl(presence_penalty=0.5), 400, "presence_penalty"),
    (CMPL, cmpl(logit_bias={"x": 1}), 400, "logit_bias"),
    (CMPL, cmpl(logit_bias={"5": "high"}), 400, None),
    (CHAT, chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    (CMPL, cmpl(best_of=4), 400, "best_of"),
    (CMPL, cmpl(suffix="tail"), 400, "suffix"),
    (CHAT, chat(chat_template_kwargs={"enable_thinking": "yes"}), 400, "chat_template_kwargs"),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    (
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
    ),
    (CHAT, chat(tools="f"), 400, "tools"),
    (
        CHAT,
        chat(
            messages=[
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}],
                }
            ]
        ),
        400,
        "messages",
    ),
    (CHAT, chat(documents=[{"text": "d"}], use_beam_search=True), 400, "documents"),
    (CMPL, cmpl(use_beam_search=True), 400, "use_beam_search"),
    (CMPL, cmpl(stream_options={"include_usage": "perhaps"}), 400, "stream_options.include_usage"),
    ("/tokenize", {"model": MODEL_NAME}, 400, None),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["code"] == status
    if param is not None:
        assert err["param"] == param, body
    return err


@pytest.mark.parametrize(("path", "raw", "status"), RAW)
def test_malformed_bodies(http: httpx.Client, path: str, raw: bytes, status: int) -> None:
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, status)


@pytest.mark.parametrize(("path", "body", "status", "param"), JSON)
def test_invalid_requests(http: httpx.Client, path: str, body: dict, status: int, param: str | None) -> None:
    assert_error(http.post(path, json=body), status, param)
    if path in (CMPL, CHAT) and status == 400 and "stream" not in body:
        assert_error(http.post(path, json={**body, "stream": True}), status)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nope"), 404)
    assert_error(http.get(CMPL), 405)
    assert_error(http.post(CMPL, content=json.dumps(cmpl()), headers={"content-type": "text/plain"}), 400)


def test_server_still_serves(server: LiveServer, http: httpx.Client) -> None:
    server.wait_idle()
    r = http.post(CMPL, json=cmpl(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = http.post(CHAT, json=chat(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    server.wait_idle()
    assert 'outcome="rejected"' in http.get("/metrics").text


@pytest.mark.parametrize("stream", [False, True])
def test_odd_text_is_served(http: httpx.Client, stream: bool) -> None:
    raw = '{"prompt": "a\\ud800b\\u0000", "max_tokens": 1, "echo": true, "logprobs": 1, "stream": %s}'
    r = http.post(CMPL, content=raw % str(stream).lower(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    chat_raw = '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1, "stream": %s}'
    r = http.post(CHAT, content=chat_raw % str(stream).lower(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_odd_text_in_error_messages(http: httpx.Client) -> None:
    raw = '{"model": "bad\\ud800", "prompt": "x"}'
    assert_error(http.post(CMPL, content=raw, headers={"content-type": "application/json"}), 404, "model")


def test_sse_event_is_one_line_to_splitlines():
    """Generated text with U+0085 / U+2028 / U+2029 (line breaks to str.splitlines, raw in JSON) still
    makes one event line for splitlines-based readers (a fuzzed stream was cut there), and decodes
    back to the same text."""
    from pydantic import BaseModel

    from metainfer.server.serving import sse

    class Chunk(BaseModel):
        text: str

    text = "a\u0085b\u2028c\u2029d\r\ne\x1cf"
    event = sse(Chunk(text=text))
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: ") :]) == {"text": text}
