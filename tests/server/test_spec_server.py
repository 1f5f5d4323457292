"""The server over an engine with n-gram speculation: greedy completions (plain and streamed, where a
step can deliver several tokens) equal plain decoding's text, and /metrics counts the drafts."""

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

PROMPT = "a, b, a, b, a, b, a,"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    import uvicorn

    engine = LLMEngine(EngineConfig(device="cpu", max_model_len=256, max_num_seqs=8, speculative="ngram"),
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


def test_speculative_completions_equal_plain_decoding(base_url):
    plain = LLM(model="", device="cpu", max_model_len=256, progress=False).generate(
        [PROMPT], SamplingParams(max_tokens=24, temperature=0))[0].text
    body = {"model": "spec", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
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
