from __future__ import annotations

import math
import random

import numpy as np
import pytest

from metainfer.bench.metrics import RequestOutcome, Stats, format_table, percentile, summarize


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy_linear(n: int) -> None:
    rng = random.Random(n)
    xs = [rng.uniform(-5, 50) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 0.0], 90) == 9.0  # unsorted input
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_stats_in_milliseconds() -> None:
    s = Stats.of_seconds([0.1, 0.2, 0.3, 0.4])
    assert s.mean == pytest.approx(250.0) and s.median == pytest.approx(250.0)
    assert s.p99 == pytest.approx(float(np.percentile([100, 200, 300, 400], 99)))
    assert s.std == pytest.approx(float(np.std([100, 200, 300, 400])))
    assert (s.min, s.max, s.count) == (pytest.approx(100.0), pytest.approx(400.0), 4)
    assert Stats.of_seconds([]).count == 0 and math.isnan(Stats.of_seconds([]).mean)


def _ok(i: int, ttft: float, lat: float, n: int, expected: int = 10, prompt: int = 5) -> RequestOutcome:
    itl = tuple([(lat - ttft) / (n - 1)] * (n - 1)) if n > 1 else ()
    return RequestOutcome(
        index=i,
        success=True,
        prompt_len=prompt,
        expected_output_len=expected,
        output_tokens=n,
        usage_prompt_tokens=prompt,
        usage_reported=True,
        ttft_s=ttft,
        latency_s=lat,
        itl_s=itl,
        num_chunks=n,
    )


def test_summarize_definitions() -> None:
    outs = [
        _ok(0, 0.1, 1.0, 10),  # tpot 0.1
        _ok(1, 0.2, 0.65, 10),  # tpot 0.05
        _ok(2, 0.3, 0.3, 1, expected=1),  # single token: no TPOT
        _ok(3, 0.1, 0.5, 5),  # short: 5 of 10
        _ok(4, 0.1, 1.2, 12, prompt=6),  # longer than asked
        RequestOutcome(index=5, success=False, prompt_len=5, expected_output_len=10, error="HTTP 500: boom"),
    ]
    m = summarize(outs, duration_s=2.0, max_concurrency=4, request_rate=math.inf, ignore_eos=True)
    assert (m.completed, m.failed) == (5, 1)
    assert m.total_input_tokens == 26 and m.total_output_tokens == 38
    assert m.request_throughput == pytest.approx(2.5) and m.output_throughput == pytest.approx(19.0)
    assert m.total_token_throughput == pytest.approx(32.0)
    assert m.tpot.count == 4 and m.tpot.mean == pytest.approx(1000 * (0.1 + 0.05 + 0.1 + 0.1) / 4)
    assert m.ttft.mean == pytest.approx(1000 * 0.8 / 5)
    assert m.itl.count == 9 + 9 + 0 + 4 + 11
    assert [(x.index, x.got) for x in m.short_outputs] == [(3, 5)]
    assert {(x.index, x.what) for x in m.length_mismatches} == {(4, "output")}
    assert m.errors == ("request 5: HTTP 500: boom",)
    flat = m.flat()
    for key in (
        "mean_ttft_ms",
        "median_tpot_ms",
        "p90_itl_ms",
        "p99_e2el_ms",
        "output_throughput",
        "completed",
    ):
        assert key in flat
    assert flat["request_rate"] == "inf"
    text = format_table(m, [("Decode ceiling, c=4 (tok/s):", 123.0)])
    assert "Decode ceiling, c=4 (tok/s):" in text and "request 3: 5 of 10 tokens" in text


def test_prompt_count_mismatch_is_reported() -> None:
    o = RequestOutcome(
        index=0,
        success=True,
        prompt_len=8,
        expected_output_len=2,
        output_tokens=2,
        usage_prompt_tokens=9,
        usage_reported=True,
        ttft_s=0.1,
        latency_s=0.2,
        itl_s=(0.1,),
    )
    m = summarize([o], 1.0, None, math.inf, ignore_eos=True)
    assert [(x.what, x.expected, x.got) for x in m.length_mismatches] == [("prompt", 8, 9)]


def test_ttft_histogram_from_prometheus_text() -> None:
    """bench serve's server-side TTFT: sum and count of `*time_to_first_token_seconds` over label sets
    (MetaInfer's and vLLM's names), None without one."""
    from metainfer.bench.client import ttft_histogram

    text = """# HELP metainfer:time_to_first_token_seconds Time to first token.
# TYPE metainfer:time_to_first_token_seconds histogram
metainfer:time_to_first_token_seconds_bucket{le="0.001",model_name="a"} 0.0
metainfer:time_to_first_token_seconds_count{model_name="a"} 3.0
metainfer:time_to_first_token_seconds_sum{model_name="a"} 0.09
metainfer:time_to_first_token_seconds_count{model_name="b"} 1.0
metainfer:time_to_first_token_seconds_sum{model_name="b"} 0.01
metainfer:time_per_output_token_seconds_sum{model_name="a"} 5.0
"""
    s, c = ttft_histogram(text)
    assert c == 4.0 and abs(s - 0.1) < 1e-12
    assert ttft_histogram('vllm:time_to_first_token_seconds_sum{engine="0"} 2.5\n'
                          'vllm:time_to_first_token_seconds_count{engine="0"} 10\n') == (2.5, 10.0)
    assert ttft_histogram("vllm:e2e_request_latency_seconds_sum 1.0\n") is None


def test_spec_counters_and_server_extra_from_prometheus_text() -> None:
    """bench serve's server-side speculative figures: our `metainfer:spec_*_tokens_total` and vLLM v1's
    `vllm:spec_decode_num_*_tokens_total` counters (summed over label sets), differenced over the run;
    none without them; the TTFT mean beside them."""
    from metainfer.bench.client import server_extra, spec_counters

    ttft = "metainfer:time_to_first_token_seconds_{} {}\n"
    ours = ("metainfer:spec_draft_tokens_total 40.0\nmetainfer:spec_accepted_tokens_total 30.0\n"
            + ttft.format("sum", 0.5) + ttft.format("count", 10))
    later = ("metainfer:spec_draft_tokens_total 100.0\nmetainfer:spec_accepted_tokens_total 75.0\n"
             + ttft.format("sum", 0.8) + ttft.format("count", 13))
    assert spec_counters(ours) == (40.0, 30.0)
    ex = server_extra(ours, later)
    assert ex["server_spec_draft_tokens"] == 60.0 and ex["server_spec_accepted_tokens"] == 45.0
    assert ex["server_spec_acceptance"] == 0.75 and abs(ex["server_mean_ttft_ms"] - 100.0) < 1e-9
    vllm = ('vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 4.0\n'
            'vllm:spec_decode_num_draft_tokens_created{engine="0"} 1.7e9\n')
    assert spec_counters(vllm) == (12.0, 5.0)
    assert spec_counters("vllm:generation_tokens_total 5.0\n") is None
    assert server_extra(None, later) == {} and "server_spec_acceptance" not in server_extra(ours, ours)
