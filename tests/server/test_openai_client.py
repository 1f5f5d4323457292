"""The official `openai` client against the live server: completions, chat, streaming, usage, stop
strings, seeds, n, logprobs, echo; plus /v1/models, /tokenize, /detokenize and /metrics."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, LiveServer, n_tokens

CHAT = [{"role": "user", "content": "Say hello."}]


def test_completion_usage_and_finish(client: openai.OpenAI, server: LiveServer) -> None:
    r = client.completions.create(
        model=MODEL_NAME, prompt="Hello there", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.model == MODEL_NAME and len(r.choices) == 1
    c = r.choices[0]
    assert c.finish_reason == "length" and c.text
    assert r.usage.prompt_tokens == n_tokens(server, "Hello there")
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_completion_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt="Once", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_chat_completion(client: openai.OpenAI, server: LiveServer) -> None:
    no_think = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0, extra_body=no_think
    )
    assert r.object == "chat.completion"
    m = r.choices[0].message
    assert m.role == "assistant" and isinstance(m.content, str) and m.reasoning_content is None
    assert r.choices[0].finish_reason == "length"
    from metainfer.tokenizer import apply_chat_template

    assert r.usage.prompt_tokens == n_tokens(server, apply_chat_template(CHAT, enable_thinking=False))
    assert r.usage.completion_tokens == 5


def test_chat_enable_thinking_changes_prompt(client: openai.OpenAI, server: LiveServer) -> None:
    on = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1)
    off = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    from metainfer.tokenizer import apply_chat_template

    expected = n_tokens(server, apply_chat_template(CHAT, enable_thinking=False))
    assert off.usage.prompt_tokens == expected != on.usage.prompt_tokens


def test_chat_default_max_tokens_is_remaining_context(client: openai.OpenAI, server: LiveServer) -> None:
    long = [{"role": "user", "content": "word " * 480}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=long, extra_body={"ignore_eos": True})
    assert r.usage.total_tokens == MAX_MODEL_LEN and r.choices[0].finish_reason == "length"


def test_completion_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="Stream me",
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert all(c.usage is None for c in text_chunks)
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 7
    full = client.completions.create(
        model=MODEL_NAME, prompt="Stream me", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    greedy = client.completions.create(
        model=MODEL_NAME,
        prompt="Stream me",
        max_tokens=7,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in greedy if c.choices) == full.choices[0].text


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=4,
        stream=True,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    m = whole.choices[0].message
    assert (reasoning, content) == (m.reasoning_content or "", m.content or "")


def test_sse_framing(server: LiveServer, http: httpx.Client) -> None:
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and len(events) == 3


def test_stop_string(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL_NAME, prompt="The stop test", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=24, **kw).choices[0].text
    k = len(full) // 2
    stop = full[k : k + 2]
    expected = full[: full.find(stop)]
    r = client.completions.create(max_tokens=24, stop=[stop], **kw)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("stop_reason") == stop
    streamed = client.completions.create(max_tokens=24, stop=stop, stream=True, **kw)
    chunks = [c for c in streamed if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL_NAME, prompt="Token stop", temperature=0, max_tokens=10)
    first = client.completions.create(
        **kw, logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}
    )
    ids = [int(t.removeprefix("token_id:")) for t in first.choices[0].logprobs.tokens]
    stop_id = ids[3]
    r = client.completions.create(**kw, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("stop_reason") == stop_id
    assert r.usage.completion_tokens == ids.index(stop_id) + 1


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    kw = dict(
        model=MODEL_NAME, prompt="Random", max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True}
    )
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=4321, **kw).choices[0].text
    assert a == b
    assert a != c
    with ThreadPoolExecutor(4) as pool:  # batched with other requests: still the same text
        texts = list(
            pool.map(lambda s: client.completions.create(seed=s, **kw).choices[0].text, [1234, 9, 1234])
        )
    assert texts[0] == texts[2] == a != texts[1]
    chat_kw = dict(
        model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True}
    )
    x, y, z = (client.chat.completions.create(seed=s, **chat_kw).choices[0].message for s in (7, 7, 8))
    assert (x.reasoning_content, x.content) == (y.reasoning_content, y.content)
    assert (x.reasoning_content, x.content) != (z.reasoning_content, z.content)


def test_n_choices_distinct_seeds(client: openai.OpenAI) -> None:
    kw = dict(
        model=MODEL_NAME, prompt="Many", max_tokens=8, temperature=1.0, n=3, extra_body={"ignore_eos": True}
    )
    r = client.completions.create(seed=99, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3
    assert r.usage.completion_tokens == 24
    again = client.completions.create(seed=99, **kw)
    assert [c.text for c in again.choices] == texts
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=3, n=2, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 6


def test_prompt_list_and_token_ids(client: openai.OpenAI, server: LiveServer) -> None:
    ids = server.engine.tokenizer.encode("Hello there")
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=["Hello there", "Bye"],
        max_tokens=3,
        n=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(ids) + n_tokens(server, "Bye")
    assert r.usage.completion_tokens == 12
    by_ids = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == r.choices[0].text == r.choices[1].text
    multi = client.completions.create(
        model=MODEL_NAME, prompt=[ids, ids[:1]], max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert len(multi.choices) == 2 and multi.usage.prompt_tokens == len(ids) + 1


def test_logprobs_and_echo(client: openai.OpenAI, server: LiveServer) -> None:
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="Log probs",
        max_tokens=4,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4 and top[tok] == value
        assert value == max(top.values())  # greedy picks the most likely token
    n_prompt = n_tokens(server, "Log probs")
    e = client.completions.create(
        model=MODEL_NAME,
        prompt="Log probs",
        max_tokens=4,
        temperature=0,
        logprobs=1,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    assert e.choices[0].text == "Log probs" + r.choices[0].text
    elp = e.choices[0].logprobs
    assert len(elp.tokens) == n_prompt + 4 and elp.token_logprobs[0] is None
    assert all(v is not None for v in elp.token_logprobs[1:])
    assert elp.text_offset[n_prompt] == len("Log probs")
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_models_tokenize_detokenize(server: LiveServer, http: httpx.Client, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME, "alias"]
    tok = http.post("/tokenize", json={"model": "alias", "prompt": "Hello world", "return_token_strs": True})
    assert tok.status_code == 200
    body = tok.json()
    assert body["tokens"] == server.engine.tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert "".join(body["token_strs"]) == "Hello world"
    chat_tok = http.post("/tokenize", json={"messages": CHAT}).json()
    from metainfer.tokenizer import apply_chat_template

    assert chat_tok["count"] == n_tokens(server, apply_chat_template(CHAT))
    detok = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert detok.json() == {"prompt": "Hello world"}
    alias = client.completions.create(model="alias", prompt="a", max_tokens=1)
    assert alias.model == MODEL_NAME


def test_health_and_metrics(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    text = http.get("/metrics").text
    for name in (
        "metainfer:requests_total",
        "metainfer:prompt_tokens_total",
        "metainfer:generation_tokens_total",
        "metainfer:time_to_first_token_seconds_bucket",
        "metainfer:time_per_output_token_seconds_bucket",
        "metainfer:e2e_request_latency_seconds_bucket",
        "metainfer:num_requests_running",
        "metainfer:num_requests_waiting",
        "metainfer:kv_blocks_used",
        "metainfer:state_slots_used",
        "metainfer:num_preemptions_total",
    ):
        assert name in text, name
