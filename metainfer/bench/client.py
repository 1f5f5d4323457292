"""Asynchronous streaming load generator for an OpenAI-compatible `/v1/completions` endpoint.

Requests arrive as a Poisson process at `request_rate` (inf: all at once) and are bounded by a
`max_concurrency` semaphore. Each request streams (SSE) with `stream_options.include_usage`, greedy,
and `ignore_eos` as an extra body field (vLLM's convention). Failures (HTTP errors, error events,
dropped connections) are recorded per request; they never stop the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from metainfer.bench.datasets import SampleRequest
from metainfer.bench.metrics import RequestOutcome, ServeMetrics, summarize


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000
    model: str
    endpoint: str = "/v1/completions"
    max_concurrency: int | None = None  # None: unbounded
    request_rate: float = math.inf  # req/s
    ignore_eos: bool = True
    seed: int = 0
    warmup: int = 0  # requests sent (and discarded) before timing
    temperature: float = 0.0
    timeout_s: float = 6 * 3600.0
    extra_body: str = ""  # a JSON object merged into every request (e.g. a guided_json constraint)

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be positive (inf for all at once)")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if self.extra_body and not isinstance(json.loads(self.extra_body), dict):
            raise ValueError("extra_body must be a JSON object")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


@dataclass(frozen=True)
class ServeRun:
    outcomes: tuple[RequestOutcome, ...]
    metrics: ServeMetrics


def request_body(cfg: ClientConfig, req: SampleRequest) -> dict[str, Any]:
    return {
        "model": cfg.model,
        "prompt": req.payload_prompt,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": cfg.ignore_eos,
        **(json.loads(cfg.extra_body) if cfg.extra_body else {}),
    }


async def send_one(
    session: Any, cfg: ClientConfig, req: SampleRequest, index: int, t0: float
) -> RequestOutcome:
    """One streamed completion; never raises (errors become a failed outcome)."""
    body = request_body(cfg, req)
    base = {"index": index, "prompt_len": req.prompt_len, "expected_output_len": req.output_len}
    start = time.perf_counter()
    chunk_times: list[float] = []  # perf_counter of each chunk carrying a token
    usage: dict[str, Any] | None = None
    finish: str | None = None
    try:
        async with session.post(cfg.url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                return RequestOutcome(
                    success=False, error=f"HTTP {resp.status}: {text}", start_s=start - t0, **base
                )
            async for raw in resp.content:
                now = time.perf_counter()
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    return RequestOutcome(
                        success=False, error=f"stream error: {msg}", start_s=start - t0, **base
                    )
                if choices := event.get("choices"):
                    reason = choices[0].get("finish_reason")
                    if choices[0].get("text") or reason is None:  # not a bare finish marker
                        chunk_times.append(now)
                    finish = reason or finish
                if event.get("usage"):
                    usage = event["usage"]
        end = time.perf_counter()
    except Exception as e:
        return RequestOutcome(success=False, error=f"{type(e).__name__}: {e}", start_s=start - t0, **base)
    if not chunk_times:
        return RequestOutcome(
            success=False, error="stream ended without any token", start_s=start - t0, **base
        )
    n_out = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else len(chunk_times)
    usage_prompt = int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else None
    itl = tuple(b - a for a, b in zip(chunk_times, chunk_times[1:]))
    return RequestOutcome(
        success=True,
        output_tokens=n_out,
        usage_prompt_tokens=usage_prompt,
        usage_reported=usage is not None,
        ttft_s=chunk_times[0] - start,
        latency_s=end - start,
        itl_s=itl,
        num_chunks=len(chunk_times),
        finish_reason=finish,
        start_s=start - t0,
        **base,
    )


def _session(cfg: ClientConfig) -> Any:
    import aiohttp

    limit = cfg.max_concurrency or 0
    connector = aiohttp.TCPConnector(limit=limit, force_close=False, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20)


async def _run_all(
    session: Any, cfg: ClientConfig, reqs: Sequence[SampleRequest], rate: float, rng: random.Random
) -> tuple[list[RequestOutcome], float]:
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    t0 = time.perf_counter()

    async def guarded(i: int, r: SampleRequest) -> RequestOutcome:
        if sem is None:
            return await send_one(session, cfg, r, i, t0)
        async with sem:
            return await send_one(session, cfg, r, i, t0)

    tasks = []
    for i, r in enumerate(reqs):
        tasks.append(asyncio.create_task(guarded(i, r)))
        if not math.isinf(rate) and i + 1 < len(reqs):
            await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals: exponential gaps
    outcomes = await asyncio.gather(*tasks)
    return list(outcomes), time.perf_counter() - t0


_TTFT_METRIC = re.compile(r"^(\S*time_to_first_token_seconds)_(sum|count)(?:\{[^}]*\})? (\S+)$", re.M)


def ttft_histogram(text: str) -> tuple[float, float] | None:
    """(sum in s, count) over every label set of a Prometheus `*time_to_first_token_seconds` histogram
    (MetaInfer's `metainfer:` and vLLM's `vllm:` metric), or None when the text has none."""
    tot = {"sum": 0.0, "count": 0.0}
    found = False
    for _, kind, value in _TTFT_METRIC.findall(text):
        tot[kind] += float(value)
        found = True
    return (tot["sum"], tot["count"]) if found else None


# speculative decoding counters: ours, and vLLM v1's (`vllm:spec_decode_num_*_tokens_total`)
_SPEC_METRIC = re.compile(r"^(?:metainfer:spec_(draft|accepted)_tokens_total"
                          r"|vllm:spec_decode_num_(draft|accepted)_tokens_total)(?:\{[^}]*\})? (\S+)$", re.M)


def spec_counters(text: str) -> tuple[float, float] | None:
    """(draft tokens, accepted tokens) summed over label sets of the server's speculative counters, or
    None when the text has none (no speculation configured, or a server without them)."""
    tot = {"draft": 0.0, "accepted": 0.0}
    found = False
    for ours, vllm, value in _SPEC_METRIC.findall(text):
        tot[ours or vllm] += float(value)
        found = True
    return (tot["draft"], tot["accepted"]) if found else None


async def _server_metrics(session: Any, base_url: str) -> str | None:
    """The server's GET /metrics text (None when it does not answer)."""
    import aiohttp

    try:
        async with session.get(base_url.rstrip("/") + "/metrics") as r:
            return await r.text() if r.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None


def server_extra(before: str | None, after: str | None) -> dict[str, float]:
    """What the server's own counters say about a run (/metrics before and after it): the mean TTFT from
    its histogram (`server_mean_ttft_ms`: the client's mean minus it is HTTP, queues and streaming) and,
    where it speculates, the draft tokens verified and accepted and their ratio."""
    if before is None or after is None:
        return {}
    out: dict[str, float] = {}
    t0, t1 = ttft_histogram(before), ttft_histogram(after)
    if t0 is not None and t1 is not None and t1[1] > t0[1]:
        out["server_mean_ttft_ms"] = (t1[0] - t0[0]) / (t1[1] - t0[1]) * 1000.0
    s0, s1 = spec_counters(before), spec_counters(after)
    if s0 is not None and s1 is not None:
        drafted, accepted = s1[0] - s0[0], s1[1] - s0[1]
        out["server_spec_draft_tokens"], out["server_spec_accepted_tokens"] = drafted, accepted
        if drafted > 0:
            out["server_spec_acceptance"] = accepted / drafted
    return out


async def run_async(cfg: ClientConfig, reqs: Sequence[SampleRequest]) -> ServeRun:
    """The requests (after `warmup` discarded ones); what the server's /metrics says about the run (its
    own mean TTFT, speculative drafts and acceptance: `server_extra`) goes in the metrics' extra."""
    if not reqs:
        raise ValueError("no requests")
    rng = random.Random(cfg.seed)
    async with _session(cfg) as session:
        if cfg.warmup:
            warm = [reqs[i % len(reqs)] for i in range(cfg.warmup)]
            await _run_all(session, cfg, warm, math.inf, rng)
        before = await _server_metrics(session, cfg.base_url)
        outcomes, duration = await _run_all(session, cfg, reqs, cfg.request_rate, rng)
        after = await _server_metrics(session, cfg.base_url) if before is not None else None
    metrics = summarize(outcomes, duration, cfg.max_concurrency, cfg.request_rate, cfg.ignore_eos)
    extra = server_extra(before, after)
    if extra:
        metrics = replace(metrics, extra={**metrics.extra, **extra})
    return ServeRun(outcomes=tuple(outcomes), metrics=metrics)


def run(cfg: ClientConfig, reqs: Sequence[SampleRequest]) -> ServeRun:
    """Synchronous entry point: runs the benchmark in a fresh event loop."""
    return asyncio.run(run_async(cfg, reqs))


async def wait_for_health(base_url: str, timeout_s: float, proc_alive: Any = None) -> bool:
    """Polls GET {base_url}/health until 200; False on timeout or when `proc_alive()` turns false."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    url = base_url.rstrip("/") + "/health"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        while time.monotonic() < deadline:
            if proc_alive is not None and not proc_alive():
                return False
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return True
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.5)
    return False


async def served_model_card(base_url: str) -> dict | None:
    """The first model listed by GET /v1/models (its `id`, and where the server says them its
    `max_model_len` and `vocab_size`), if any."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        try:
            async with s.get(base_url.rstrip("/") + "/v1/models") as r:
                if r.status != 200:
                    return None
                data = await r.json()
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None
    models = (data.get("data") or []) if isinstance(data, dict) else []
    return models[0] if models and isinstance(models[0], dict) and "id" in models[0] else None


async def served_model_name(base_url: str) -> str | None:
    """The first model id listed by GET /v1/models, if any."""
    card = await served_model_card(base_url)
    return None if card is None else str(card["id"])
