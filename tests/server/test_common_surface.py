"""The rest of the common OpenAI surface with the official `openai` client against the live server and
the embedded default model: n choices (stream and not, usage), logit_bias, stop strings that span
tokens in a stream, echo, user, usage in streams (include_usage, continuous_usage_stats)."""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from metainfer.engine.request import SamplingParams
from tests.server.conftest import MODEL_NAME, LiveServer, n_tokens

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
CHAT = [{"role": "user", "content": "Say hello."}]


def greedy_tokens(client: openai.OpenAI, prompt: str, n: int) -> tuple[str, list[int], list[str], list[int]]:
    """The greedy completion of `prompt`: (text, token ids, token texts, text offsets)."""
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=n, temperature=0, logprobs=0)
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    ids = (
        client.completions.create(**kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        .choices[0]
        .logprobs.tokens
    )
    lp = r.choices[0].logprobs
    return r.choices[0].text, [int(t.removeprefix("token_id:")) for t in ids], lp.tokens, lp.text_offset


# ---- n > 1 -----------------------------------------------------------------------------------------


def test_n_completions_stream_matches_non_stream(client: openai.OpenAI, server: LiveServer) -> None:
    kw = dict(model=MODEL_NAME, prompt="Three ways", max_tokens=6, temperature=1.0, n=3, seed=5)
    whole = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.text for c in whole.choices}) == 3
    n_prompt = n_tokens(server, "Three ways")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (n_prompt, 18)
    chunks = list(
        client.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
    )
    order = [c.choices[0].index for c in chunks if c.choices]
    texts, finish = defaultdict(str), {}
    for c in chunks[:-1]:
        (ch,) = c.choices
        texts[ch.index] += ch.text
        assert ch.index not in finish, "a chunk after the choice's finish"
        if ch.finish_reason:
            finish[ch.index] = ch.finish_reason
        assert c.usage is None
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert order.index(1) < len(order) - order[::-1].index(0) - 1, f"choices not interleaved: {order}"
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens == n_prompt and last.usage.completion_tokens == 18
    assert last.usage.total_tokens == n_prompt + 18


def test_n_chat_stream_and_greedy_choices(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL_NAME, messages=CHAT, max_tokens=5, n=3, seed=11, temperature=1.0)
    body = {"ignore_eos": True, **NO_THINK}
    whole = client.chat.completions.create(**kw, extra_body=body)
    assert [c.index for c in whole.choices] == [0, 1, 2] and whole.usage.completion_tokens == 15
    chunks = list(
        client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}, extra_body=body
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [0, 1, 2]
    content = defaultdict(str)
    for c in chunks:
        if c.choices:
            content[c.choices[0].index] += c.choices[0].delta.content or ""
    assert [content[i] for i in range(3)] == [c.message.content for c in whole.choices]
    finals = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finals == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    greedy = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=4, n=2, temperature=0, extra_body=body
    )
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_continuous_usage_stats(client: openai.OpenAI, server: LiveServer) -> None:
    """vLLM's continuous_usage_stats: every chunk carries its prompt's and its choice's usage so far."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    n_prompt = n_tokens(server, "Counting")
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="Counting",
            max_tokens=4,
            n=2,
            stream=True,
            stream_options=opts,
            extra_body={"ignore_eos": True},
        )
    )
    seen = defaultdict(int)
    for c in chunks[:-1]:
        i = c.choices[0].index
        assert c.usage.prompt_tokens == n_prompt and c.usage.completion_tokens >= seen[i]
        seen[i] = c.usage.completion_tokens
        assert c.usage.total_tokens == n_prompt + seen[i]
    assert dict(seen) == {0: 4, 1: 4}
    assert chunks[-1].usage.completion_tokens == 8
    chat = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=3,
            stream=True,
            stream_options=opts,
            extra_body={"ignore_eos": True},
        )
    )
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert all(c.usage is not None for c in chat)
    assert [c.usage.completion_tokens for c in chat if c.choices][-1] == 3 == chat[-1].usage.completion_tokens


# ---- logit_bias ------------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans(client: openai.OpenAI, server: LiveServer) -> None:
    text, ids, _, _ = greedy_tokens(client, "Bias me", 5)
    kw = dict(model=MODEL_NAME, prompt="Bias me", max_tokens=5, temperature=0, logprobs=0)
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    forced_id = 1000 if ids[0] != 1000 else 1001
    forced = client.completions.create(**kw, logit_bias={str(forced_id): 100}, extra_body=body)
    assert forced.choices[0].logprobs.tokens == [f"token_id:{forced_id}"] * 5
    banned = client.completions.create(**kw, logit_bias={str(ids[0]): -100}, extra_body=body)
    got = [int(t.removeprefix("token_id:")) for t in banned.choices[0].logprobs.tokens]
    assert ids[0] not in got
    sampled = client.completions.create(
        model=MODEL_NAME,
        prompt="Bias me",
        max_tokens=4,
        temperature=1.0,
        n=2,
        seed=3,
        logit_bias={str(forced_id): 100},
        logprobs=0,
        extra_body=body,
    )
    assert all(c.logprobs.tokens == [f"token_id:{forced_id}"] * 4 for c in sampled.choices)
    plain = client.completions.create(
        model=MODEL_NAME, prompt="Bias me", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].text == text  # a finished biased request leaves no trace
    server.wait_idle()
    assert server.engine.runner.logits_hook is None  # the bias hook goes with the last biased request


def test_logit_bias_chat_stream_beside_unbiased(client: openai.OpenAI, server: LiveServer) -> None:
    """A biased stream and an unbiased request in the same steps: each gets what it would alone."""
    word = server.engine.tokenizer.encode(" yes")[0]
    piece = server.engine.tokenizer.decode([word])
    kw = dict(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0)
    body = {"ignore_eos": True, **NO_THINK}
    alone = client.chat.completions.create(**kw, extra_body=body).choices[0].message.content

    def biased() -> str:
        stream = client.chat.completions.create(
            **kw, stream=True, logit_bias={str(word): 100}, extra_body=body
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(2) as pool:
        b = pool.submit(biased)
        p = pool.submit(
            lambda: client.chat.completions.create(**kw, extra_body=body).choices[0].message.content
        )
        assert b.result() == piece * 4
        assert p.result() == alone


# ---- stop strings across tokens in a stream ----------------------------------------------------------


def _boundary_stop(tokens: list[str], offsets: list[int], text: str, span: int) -> tuple[str, int] | None:
    """A stop string made of token k's last character and the first characters of the next `span - 1`
    tokens (all printable ASCII), whose first occurrence in `text` is there: (stop, its offset)."""
    for k in range(1, len(tokens) - span):
        parts = tokens[k : k + span]
        if not all(p and p.isascii() and p.isprintable() for p in parts):
            continue
        if any(text[offsets[k + j] : offsets[k + j] + len(p)] != p for j, p in enumerate(parts)):
            continue
        stop = parts[0][-1] + "".join(parts[1:-1]) + parts[-1][0]
        at = offsets[k] + len(parts[0]) - 1
        if text.find(stop) == at:
            return stop, at
    return None


@pytest.mark.parametrize("span", [2, 3])
def test_stream_stop_string_across_tokens_never_leaks(client: openai.OpenAI, span: int) -> None:
    prompt = "Once upon a time"
    text, _, tokens, offsets = greedy_tokens(client, prompt, 24)
    found = _boundary_stop(tokens, offsets, text, span)
    assert found is not None, f"no usable token boundary in {tokens}"
    stop, at = found
    expected = text[:at]
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    sent = ""
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    for c in chunks:
        sent += c.choices[0].text
        assert expected.startswith(sent), f"streamed {sent!r}, beyond {expected!r} (stop {stop!r})"
    assert sent == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra.get("stop_reason") == stop
    kept = list(
        client.completions.create(
            **kw, stream=True, extra_body={"ignore_eos": True, "include_stop_str_in_output": True}
        )
    )
    assert "".join(c.choices[0].text for c in kept) == expected + stop


def test_chat_stream_stop_string_across_tokens(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL_NAME, messages=CHAT, max_tokens=20, temperature=1.0, seed=7, logprobs=True)
    body = {"ignore_eos": True, **NO_THINK}
    whole = client.chat.completions.create(**kw, extra_body=body)
    content = whole.choices[0].message.content
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    assert "".join(tokens) == content
    found = _boundary_stop(tokens, offsets, content, 2)
    assert found is not None, f"no usable token boundary in {tokens}"
    stop, at = found
    sent = ""
    for c in client.chat.completions.create(**kw, stream=True, stop=stop, extra_body=body):
        if c.choices:
            sent += c.choices[0].delta.content or ""
            assert content[:at].startswith(sent)
            last = c.choices[0]
    assert sent == content[:at] and last.finish_reason == "stop"


# ---- echo, user --------------------------------------------------------------------------------------


def test_echo_stream_and_not(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL_NAME, prompt="Echo this", max_tokens=3, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    r = client.completions.create(**kw, echo=True, n=2, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == ["Echo this" + plain] * 2
    chunks = list(client.completions.create(**kw, echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text.startswith("Echo this")
    assert "".join(c.choices[0].text for c in chunks) == "Echo this" + plain


def test_echo_with_max_tokens_0_is_the_prompt_alone(client: openai.OpenAI, server: LiveServer) -> None:
    n_prompt = n_tokens(server, "Score me please")
    kw = dict(model=MODEL_NAME, prompt="Score me please", max_tokens=0, echo=True, logprobs=1)
    r = client.completions.create(**kw)
    (c,) = r.choices
    assert c.text == "Score me please" and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == n_prompt and c.logprobs.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 0)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Score me please"
    assert chunks[-1].usage.completion_tokens == 0
    assert chunks[-2].choices[0].logprobs.token_logprobs == c.logprobs.token_logprobs


def test_user_is_accepted(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, user="user-1234")
    assert r.usage.completion_tokens >= 1
    c = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, user="user-1234")
    assert c.usage.completion_tokens >= 1


# ---- bad values --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "kwargs", "param"),
    [
        ("cmpl", {"logit_bias": {"abc": 5}}, "logit_bias"),
        ("cmpl", {"logit_bias": {"1000000000": 5}}, "logit_bias"),
        ("chat", {"logit_bias": {"-1": 5}}, "logit_bias"),
        ("cmpl", {"best_of": 3, "n": 2}, "best_of"),
        ("cmpl", {"max_tokens": 0}, "max_tokens"),
        ("cmpl", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("chat", {"extra_body": {"echo": True}}, "echo"),
        ("chat", {"extra_body": {"best_of": 2}}, "best_of"),
        ("chat", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ("chat", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ],
)
def test_bad_values_name_the_field(client: openai.OpenAI, kind: str, kwargs: dict, param: str) -> None:
    kwargs = {"max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "cmpl":
            client.completions.create(model=MODEL_NAME, prompt="x", **kwargs)
        else:
            client.chat.completions.create(model=MODEL_NAME, messages=CHAT, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert param in e.value.body["message"]


def test_logit_bias_values_are_clamped_and_validated(server: LiveServer) -> None:
    ctx = server.ctx
    assert ctx.logit_bias({"5": 1e9, "7": -float("inf"), "9": 0.5}) == ((5, 100.0), (7, -100.0), (9, 0.5))
    with pytest.raises(ValueError):
        SamplingParams(logit_bias={3: float("nan")})
    assert SamplingParams(logit_bias={5: 1.0, 2: -1.0}).logit_bias == ((2, -1.0), (5, 1.0))
    assert not SamplingParams(temperature=0, logit_bias={5: 1.0}).greedy
