"""`bench serve` as a function: dataset -> streaming client -> metrics -> roofline -> result object.

Roofline figures printed with every run (ceilings from `roofline.py`, for the configured machine):
- decode: concurrency C (max_concurrency, capped by the number of prompts) at the mean context
  (input + output/2); measured C/mean TPOT and the output throughput as % of the decode ceiling;
- prefill: the floor for one prompt of the mean input length vs the mean TTFT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from metainfer.bench.client import ClientConfig, ServeRun, run
from metainfer.bench.datasets import DatasetSpec, SampleRequest, load_requests
from metainfer.bench.env import build_result
from metainfer.bench.metrics import ServeMetrics, format_table
from metainfer.bench.roofline import DEFAULT_BANDWIDTH_TB_S, decode_ceiling, load_config, prefill_floor


@dataclass(frozen=True)
class RooflineSpec:
    model: str | None = None  # `dummy:PATH`, a dir or config file; None: the full Qwen3.6 config
    dtype: str = "bfloat16"
    lm_head_dtype: str | None = None
    bandwidth: float = DEFAULT_BANDWIDTH_TB_S


def roofline_figures(
    spec: RooflineSpec, m: ServeMetrics, reqs: Sequence[SampleRequest]
) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """(figures for the JSON, labelled lines for the table)."""
    cfg, path = load_config(spec.model)
    n = len(reqs)
    conc = min(m.max_concurrency or n, n)
    mean_in = sum(r.prompt_len for r in reqs) / n
    mean_out = sum(r.output_len for r in reqs) / n
    dec = decode_ceiling(
        cfg, spec.dtype, conc, int(mean_in + mean_out / 2), spec.bandwidth, spec.lm_head_dtype
    )
    pre = prefill_floor(cfg, spec.dtype, max(1, int(mean_in)), spec.bandwidth, spec.lm_head_dtype)
    decode_all = conc * m.decode_tok_s_per_stream
    pct = 100.0 * decode_all / dec.tok_s if not math.isnan(decode_all) else math.nan
    out_pct = 100.0 * m.output_throughput / dec.tok_s
    ttft_pct = (
        100.0 * pre.step_time_s * 1000.0 / m.ttft.mean if m.ttft.count and m.ttft.mean > 0 else math.nan
    )
    fig = {
        "config_path": str(path),
        "dtype": spec.dtype,
        "lm_head_dtype": dec.cost.lm_head_dtype,
        "bandwidth_tb_s": spec.bandwidth,
        "concurrency": conc,
        "context": dec.cost.context,
        "decode_ceiling_tok_s": dec.tok_s,
        "decode_tok_s_all_streams": decode_all,
        "decode_pct_of_ceiling": pct,
        "output_throughput_pct_of_ceiling": out_pct,
        "prefill_floor_ms": pre.step_time_s * 1000.0,
        "ttft_floor_pct_of_mean_ttft": ttft_pct,
    }
    lines = [
        ("Roofline:", f"{path.name} {spec.dtype} @ {spec.bandwidth:g} TB/s"),
        (f"Decode ceiling, c={conc} (tok/s):", dec.tok_s),
        ("Decode c/TPOT (tok/s, % ceiling):", f"{decode_all:.1f} ({pct:.1f}%)"),
        ("Output throughput (% ceiling):", out_pct),
        ("Prefill floor, mean prompt (ms):", pre.step_time_s * 1000.0),
        ("Prefill floor / mean TTFT (%):", ttft_pct),
    ]
    return fig, lines


def serve_benchmark(
    client: ClientConfig,
    dataset: DatasetSpec,
    roofline: RooflineSpec | None = RooflineSpec(),
    engine: str = "server",
    workload: str | None = None,
    verdict: str | None = None,
    argv: list[str] | None = None,
    tokenizer_dir: str | None = None,
    reqs: Sequence[SampleRequest] | None = None,
) -> tuple[dict[str, Any], str, ServeRun]:
    """Runs one serving benchmark; returns (result object, printed table, raw run)."""
    if reqs is None:
        from metainfer.tokenizer import load_tokenizer

        reqs = load_requests(dataset, load_tokenizer(tokenizer_dir))
    result = run(client, reqs)
    m = result.metrics
    fig: dict[str, Any] | None = None
    lines: list[tuple[str, Any]] = []
    if roofline is not None:
        fig, lines = roofline_figures(roofline, m, reqs)
    table = format_table(m, lines)
    name = (
        workload
        or f"c{client.max_concurrency or 'inf'}-{dataset.name}-{dataset.input_len}x{dataset.output_len}"
    )
    config = {
        "client": asdict(client),
        "dataset": asdict(dataset),
        "num_requests": len(reqs),
        "roofline": asdict(roofline) if roofline else None,
        "tokenizer": tokenizer_dir,
    }
    per_request = [
        {
            "index": o.index,
            "success": o.success,
            "prompt_len": o.prompt_len,
            "expected_output_len": o.expected_output_len,
            "output_tokens": o.output_tokens,
            "usage_prompt_tokens": o.usage_prompt_tokens,
            "num_chunks": o.num_chunks,
            "ttft_ms": o.ttft_s * 1000.0,
            "e2el_ms": o.latency_s * 1000.0,
            "finish_reason": o.finish_reason,
            "error": o.error,
        }
        for o in result.outcomes
    ]
    obj = build_result(
        kind="serve",
        engine=engine,
        workload=name,
        config=config,
        metrics=m.flat(),
        roofline=fig,
        verdict=verdict,
        argv=argv,
        summary=m.to_dict(),
        requests=per_request,
    )
    return obj, table, result


def run_ok(m: ServeMetrics) -> bool:
    """No failed request and no short output."""
    return m.failed == 0 and not m.short_outputs and m.completed > 0
