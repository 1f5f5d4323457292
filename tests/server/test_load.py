"""128 concurrent streaming requests, a quarter of them disconnecting mid-stream: the rest complete with
their full token count, nothing answers 5xx, and afterwards every cache block and state slot is free."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME, LiveServer

N_REQUESTS = 128
MAX_TOKENS = 12
DISCONNECT_AFTER = 2  # token chunks


@dataclass
class Result:
    status: int
    disconnected: bool = False
    token_chunks: int = 0
    finish: str | None = None
    usage: dict | None = None
    done: bool = False


def metrics(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


async def one(client: httpx.AsyncClient, i: int, disconnect: bool) -> Result:
    chat = i % 2 == 1
    body: dict = {
        "model": MODEL_NAME,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": f"request number {i}"}]
    else:
        body["prompt"] = f"load test request number {i}"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", path, json=body) as r:
        res = Result(r.status_code)
        if r.status_code != 200:
            await r.aread()
            return res
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            if data == "[DONE]":
                res.done = True
                break
            ev = json.loads(data)
            assert "error" not in ev, ev
            if ev.get("usage"):
                res.usage = ev["usage"]
            for c in ev["choices"]:
                if chat and c["delta"].get("role"):
                    continue
                res.token_chunks += 1
                res.finish = c["finish_reason"] or res.finish
            if disconnect and res.token_chunks >= DISCONNECT_AFTER:
                res.disconnected = True
                return res
    return res


async def run_load(base_url: str) -> list[Result]:
    limits = httpx.Limits(max_connections=N_REQUESTS * 2, max_keepalive_connections=N_REQUESTS * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        return await asyncio.gather(*(one(client, i, i % 4 == 0) for i in range(N_REQUESTS)))


@pytest.mark.timeout(300)
def test_concurrent_streams_with_disconnects(server: LiveServer, http: httpx.Client) -> None:
    server.wait_idle()
    before = metrics(http)
    peak = [0]
    sampling = threading.Event()

    def sample_running() -> None:
        while not sampling.wait(0.02):
            peak[0] = max(peak[0], server.ctx.engine.snapshot.num_running)

    sampler = threading.Thread(target=sample_running)
    sampler.start()
    t0 = time.monotonic()
    try:
        results = asyncio.run(run_load(server.base_url))
    finally:
        sampling.set()
        sampler.join()
    elapsed = time.monotonic() - t0
    assert peak[0] > N_REQUESTS // 2, f"only {peak[0]} requests ran at once"
    assert all(r.status == 200 for r in results), [r.status for r in results]
    dropped = [r for r in results if r.disconnected]
    finished = [r for r in results if not r.disconnected]
    assert len(dropped) == N_REQUESTS // 4 and len(finished) == N_REQUESTS - N_REQUESTS // 4
    for r in finished:
        assert r.done and r.finish == "length", r
        assert r.token_chunks == MAX_TOKENS, r
        assert r.usage is not None and r.usage["completion_tokens"] == MAX_TOKENS, r

    server.wait_idle(timeout=60)
    usage = server.engine.cache.usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0, usage
    assert not server.engine.has_unfinished() and not server.engine.requests
    after = metrics(http)
    gauges = {
        name: after[(f"metainfer:{name}", ())]
        for name in ("kv_blocks_used", "state_slots_used", "num_requests_running", "num_requests_waiting")
    }
    assert gauges == dict.fromkeys(gauges, 0.0), gauges
    assert after[("metainfer:kv_blocks_total", ())] == usage["kv_blocks_total"]

    def delta(outcome: str) -> float:
        key = ("metainfer:requests_total", (("outcome", outcome),))
        return after[key] - before.get(key, 0.0)

    assert delta("abort") == len(dropped), "every disconnect aborts its request before it finishes"
    assert delta("length") == len(finished)
    assert delta("error") == 0
    gen = after[("metainfer:generation_tokens_total", ())] - before[("metainfer:generation_tokens_total", ())]
    assert len(finished) * MAX_TOKENS + len(dropped) * DISCONNECT_AFTER <= gen < N_REQUESTS * MAX_TOKENS
    print(
        f"\n{N_REQUESTS} streams ({len(dropped)} dropped, peak {peak[0]} running) in {elapsed:.1f} s; "
        f"{gen:.0f} tokens generated"
    )


@pytest.mark.timeout(300)
def test_non_stream_disconnect_aborts(server: LiveServer, http: httpx.Client) -> None:
    server.wait_idle()
    before = metrics(http)
    body = {"model": MODEL_NAME, "prompt": "never read", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    server.wait_idle(timeout=30)
    after = metrics(http)
    key = ("metainfer:requests_total", (("outcome", "abort"),))
    assert after[key] - before[key] == 1
    gen = after[("metainfer:generation_tokens_total", ())] - before[("metainfer:generation_tokens_total", ())]
    assert gen < 480
