"""The server over an engine with n-gram or MTP speculation: greedy completions (plain and streamed,
where a step can deliver several tokens) equal plain decoding's text, /metrics counts the drafts, and
concurrent requests beside a bad one all end as plain decoding would."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from metainfer.config import EngineConfig
from metainfer.engine.engine import LLMEngine
from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM
from metainfer.server.api import build_app, make_context
from tests.server.conftest import free_port

PROMPTS = {"ngram": "a, b, a, b, a, b, a,", "mtp": "class Parser(object):\n    def __init__(self"}


@pytest.fixture(scope="module", params=["ngram", "mtp"])
def spec(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def base_url(spec) -> Iterator[str]:
    import uvicorn

    engine = LLMEngine(EngineConfig(device="cpu", max_model_len=256, max_num_seqs=8, speculative=spec),
                       progress=False)
    ctx = make_context(engine, ["spec"])
    srv = uvicorn.Server(uvicorn.Config(build_app(ctx, shutdown_timeout=5.0), host="127.0.0.1",
                                        port=free_port(), log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{srv.config.port}"
    srv.should_exit = True
    thread.join(30)


def _plain(prompts: list[str], max_tokens: int) -> list[str]:
    outs = LLM(model="", device="cpu", max_model_len=256, progress=False).generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    return [o.text for o in outs]


def test_speculative_completions_equal_plain_decoding(base_url, spec):
    prompt = PROMPTS[spec]
    plain = _plain([prompt], 24)[0]
    body = {"model": "spec", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    with httpx.Client(base_url=base_url, timeout=120) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain
        chunks = []
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(chunks) == plain
        metrics = c.get("/metrics").text
    drafted = [ln for ln in metrics.splitlines() if ln.startswith("metainfer:spec_draft_tokens_total")]
    accepted = [ln for ln in metrics.splitlines() if ln.startswith("metainfer:spec_accepted_tokens_total")]
    assert drafted and accepted and float(drafted[0].split()[-1]) >= float(accepted[0].split()[-1]) > 0


def test_concurrent_requests_beside_a_bad_one(base_url, spec):
    """Three greedy completions at once (drafting pauses while several run) and one with a bad
    parameter: the bad one gets an OpenAI-style 400, the others plain decoding's text."""
    import concurrent.futures as cf

    prompts = [PROMPTS[spec], "import os\nimport sys\n", "def read_file(path):"]
    plain = _plain(prompts, 16)

    def post(body):
        with httpx.Client(base_url=base_url, timeout=120) as c:
            return c.post("/v1/completions", json=body)

    bodies = [{"model": "spec", "prompt": p, "max_tokens": 16, "temperature": 0} for p in prompts]
    bodies.append({"model": "spec", "prompt": prompts[0], "max_tokens": -3})
    with cf.ThreadPoolExecutor(4) as ex:
        rs = list(ex.map(post, bodies))
    err = rs[-1].json()["error"]
    assert rs[-1].status_code == 400 and err["type"] == "BadRequestError" and "max_tokens" in err["message"]
    assert [r.json()["choices"][0]["text"] for r in rs[:-1]] == plain


def test_bench_serve_reads_the_servers_speculative_counters(base_url, spec):
    """`bench serve` against this server: the run's drafted and accepted tokens from /metrics, in the
    metrics' extra and the printed summary."""
    from metainfer.bench.client import ClientConfig, run
    from metainfer.bench.datasets import SampleRequest
    from metainfer.bench.metrics import format_table

    reqs = [SampleRequest(prompt_len=0, output_len=24, prompt=PROMPTS[spec]) for _ in range(2)]
    res = run(ClientConfig(base_url=base_url, model="spec", max_concurrency=1, ignore_eos=False), reqs)
    ex = res.metrics.extra
    assert ex["server_spec_draft_tokens"] >= ex["server_spec_accepted_tokens"] > 0
    assert 0 < ex["server_spec_acceptance"] <= 1 and "server_mean_ttft_ms" in ex
    assert "Server draft acceptance:" in format_table(res.metrics)


def test_logit_bias_is_never_drafted(base_url, spec):
    """A greedy request with a logit_bias on a speculative server: every token is the biased one
    (the bias applies to each sampled row) and no draft is verified for it."""

    def drafted(c: httpx.Client) -> float:
        lines = [ln for ln in c.get("/metrics").text.splitlines()
                 if ln.startswith("metainfer:spec_draft_tokens_total")]
        return float(lines[0].split()[-1]) if lines else 0.0

    body = {"model": "spec", "prompt": PROMPTS[spec], "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "logit_bias": {"1000": 100}, "return_tokens_as_token_ids": True, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=120) as c:
        before = drafted(c)
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:1000"] * 8
        assert drafted(c) == before
