"""Per-request outcomes and their summary, in the terms `vllm bench serve` prints.

Definitions (times in seconds inside, milliseconds in the summary):
- TTFT: request sent -> first streamed chunk that carries a token (a choice with text, or with no
  finish_reason; a bare `finish_reason` chunk with empty text is not a token).
- ITL: gaps between consecutive such chunks (one entry per chunk after the first; a chunk that
  carries several tokens counts once, as in vLLM).
- TPOT: (E2E - TTFT) / (output_tokens - 1) per request, for requests with more than one token.
- E2E: request sent -> end of stream.
- output_tokens: the server's `usage.completion_tokens` when it reports usage, else the chunk count.
Throughputs divide totals over successful requests by the benchmark's wall duration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Stats:
    """Summary of one latency series, in milliseconds."""

    mean: float
    median: float
    p90: float
    p99: float
    std: float
    min: float
    max: float
    count: int

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> Stats:
        ms = [v * 1000.0 for v in values_s]
        if not ms:
            nan = math.nan
            return cls(nan, nan, nan, nan, nan, nan, nan, 0)
        mean = sum(ms) / len(ms)
        std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
        return cls(
            mean=mean,
            median=percentile(ms, 50.0),
            p90=percentile(ms, 90.0),
            p99=percentile(ms, 99.0),
            std=std,
            min=min(ms),
            max=max(ms),
            count=len(ms),
        )


@dataclass(frozen=True)
class RequestOutcome:
    """What happened to one request."""

    index: int  # position in the dataset
    success: bool
    prompt_len: int  # tokens, by the dataset
    expected_output_len: int  # max_tokens asked for
    output_tokens: int = 0  # usage.completion_tokens, else the chunk count
    usage_prompt_tokens: int | None = None
    usage_reported: bool = False
    ttft_s: float = 0.0
    latency_s: float = 0.0  # E2E
    itl_s: tuple[float, ...] = ()  # [num_chunks - 1]
    num_chunks: int = 0
    finish_reason: str | None = None
    error: str = ""
    start_s: float = 0.0  # perf_counter at send, relative to the benchmark's start

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LengthMismatch:
    index: int
    expected: int
    got: int
    what: str  # "output" | "prompt"


@dataclass(frozen=True)
class ServeMetrics:
    """Summary of one serving benchmark run."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # (input + output) tok/s
    max_concurrency: int | None
    request_rate: float  # req/s; inf = all at once
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2el: Stats
    short_outputs: tuple[LengthMismatch, ...] = ()  # fewer tokens than asked under ignore_eos
    length_mismatches: tuple[LengthMismatch, ...] = ()  # longer outputs; prompt counts off
    errors: tuple[str, ...] = ()  # first few failure messages
    usage_missing: int = 0  # successful requests whose stream had no usage
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def decode_tok_s_per_stream(self) -> float:
        """1 / mean TPOT: one stream's decode rate."""
        return 1000.0 / self.tpot.mean if self.tpot.count and self.tpot.mean > 0 else math.nan

    def flat(self) -> dict[str, Any]:
        """Flat figures under vLLM's JSON key names (`mean_ttft_ms`, `output_throughput`, ...)."""
        d: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "duration": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_concurrency": self.max_concurrency,
            "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
            "decode_tok_s_per_stream": self.decode_tok_s_per_stream,
            "num_short_outputs": len(self.short_outputs),
            "usage_missing": self.usage_missing,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            s: Stats = getattr(self, name)
            for key in ("mean", "median", "p90", "p99", "std"):
                d[f"{key}_{name}_ms"] = getattr(s, key)
        d.update(self.extra)
        return d

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return d


def summarize(
    outcomes: Sequence[RequestOutcome],
    duration_s: float,
    max_concurrency: int | None,
    request_rate: float,
    ignore_eos: bool,
    max_errors: int = 20,
) -> ServeMetrics:
    ok = [o for o in outcomes if o.success]
    failed = [o for o in outcomes if not o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    short: list[LengthMismatch] = []
    other: list[LengthMismatch] = []
    for o in ok:
        if o.output_tokens < o.expected_output_len and ignore_eos:
            short.append(LengthMismatch(o.index, o.expected_output_len, o.output_tokens, "output"))
        elif o.output_tokens > o.expected_output_len:
            other.append(LengthMismatch(o.index, o.expected_output_len, o.output_tokens, "output"))
        if o.usage_prompt_tokens is not None and o.usage_prompt_tokens != o.prompt_len:
            other.append(LengthMismatch(o.index, o.prompt_len, o.usage_prompt_tokens, "prompt"))
    dur = max(duration_s, 1e-9)
    tpots = [t for o in ok if (t := o.tpot_s) is not None]
    return ServeMetrics(
        completed=len(ok),
        failed=len(failed),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / dur,
        output_throughput=total_out / dur,
        total_token_throughput=(total_in + total_out) / dur,
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        ttft=Stats.of_seconds([o.ttft_s for o in ok]),
        tpot=Stats.of_seconds(tpots),
        itl=Stats.of_seconds([x for o in ok for x in o.itl_s]),
        e2el=Stats.of_seconds([o.latency_s for o in ok]),
        short_outputs=tuple(short),
        length_mismatches=tuple(other),
        errors=tuple(f"request {o.index}: {o.error}" for o in failed[:max_errors]),
        usage_missing=sum(1 for o in ok if not o.usage_reported),
    )


def _line(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = "nan" if math.isnan(value) else f"{value:.2f}"
    return f"{label:<40} {value!s:<10}"


def _rule(title: str, fill: str = "-", width: int = 50) -> str:
    return f"{title:{fill}^{width}}"


def format_table(m: ServeMetrics, roofline_lines: Sequence[tuple[str, Any] | str] = ()) -> str:
    """The `vllm bench serve` result block (same labels), then P90 lines, mismatches and roofline
    (`roofline_lines`: (label, value) rows, or whole lines as they are)."""
    out = [_rule(" Serving Benchmark Result ", "=")]
    out.append(_line("Successful requests:", m.completed))
    out.append(_line("Failed requests:", m.failed))
    if m.max_concurrency is not None:
        out.append(_line("Maximum request concurrency:", m.max_concurrency))
    if not math.isinf(m.request_rate):
        out.append(_line("Request rate configured (RPS):", m.request_rate))
    out.append(_line("Benchmark duration (s):", m.duration_s))
    out.append(_line("Total input tokens:", m.total_input_tokens))
    out.append(_line("Total generated tokens:", m.total_output_tokens))
    out.append(_line("Request throughput (req/s):", m.request_throughput))
    out.append(_line("Output token throughput (tok/s):", m.output_throughput))
    out.append(_line("Total Token throughput (tok/s):", m.total_token_throughput))
    sections = (
        ("ttft", "TTFT", "Time to First Token"),
        ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
        ("itl", "ITL", "Inter-token Latency"),
        ("e2el", "E2EL", "End-to-end Latency"),
    )
    for attr, short, title in sections:
        s: Stats = getattr(m, attr)
        out.append(_rule(title))
        out.append(_line(f"Mean {short} (ms):", s.mean))
        out.append(_line(f"Median {short} (ms):", s.median))
        out.append(_line(f"P90 {short} (ms):", s.p90))
        out.append(_line(f"P99 {short} (ms):", s.p99))
        if attr == "ttft" and "server_mean_ttft_ms" in m.extra:  # the server's own histogram (/metrics)
            server = m.extra["server_mean_ttft_ms"]
            out.append(_line("Server-side mean TTFT (ms):", server))
            out.append(_line("Client - server mean TTFT (ms):", s.mean - server))
    out.append(_rule("Decode"))
    out.append(_line("Decode tok/s per stream (1/TPOT):", m.decode_tok_s_per_stream))
    if "server_spec_draft_tokens" in m.extra:  # the server's speculative counters over the run
        out.append(_line("Server draft tokens verified:", m.extra["server_spec_draft_tokens"]))
        out.append(_line("Server draft tokens accepted:", m.extra["server_spec_accepted_tokens"]))
        if "server_spec_acceptance" in m.extra:
            out.append(_line("Server draft acceptance:", m.extra["server_spec_acceptance"]))
    for row in roofline_lines:
        out.append(row if isinstance(row, str) else _line(*row))
    if m.short_outputs or m.length_mismatches or m.usage_missing or m.errors:
        out.append(_rule("Problems"))
        if m.short_outputs:
            out.append(_line("Short outputs (ignore_eos):", len(m.short_outputs)))
            out.extend(f"  request {x.index}: {x.got} of {x.expected} tokens" for x in m.short_outputs[:50])
        for x in m.length_mismatches[:50]:
            out.append(f"  request {x.index}: {x.what} {x.got} tokens, expected {x.expected}")
        if m.usage_missing:
            out.append(_line("Streams without usage (counted chunks):", m.usage_missing))
        out.extend(f"  {e}" for e in m.errors)
    out.append("=" * 50)
    return "\n".join(out)
