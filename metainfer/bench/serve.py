"""`bench serve` as a function: dataset -> streaming client -> metrics -> roofline -> result object.

Roofline figures printed with every run (ceilings from `roofline.py`, for the configured machine):
- decode: concurrency C (max_concurrency, capped by the number of prompts) at the mean context
  (input + output/2); measured C/mean TPOT and the output throughput as % of the decode ceiling;
- prefill: the floor for one prompt of the mean input length vs the mean TTFT.
The rows sit under a title naming the GPU, model and precision they assume. They are omitted, with
one line saying why, when the server's /v1/models says it runs on the CPU or serves another model
(its vocab_size, hidden_size, num_hidden_layers or num_experts differ from the roofline's config).
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
from metainfer.bench.roofline import (
    DEFAULT_BANDWIDTH_TB_S,
    assumption_label,
    decode_ceiling,
    gpu_label,
    load_config,
    model_label,
    prefill_floor,
)
from metainfer.config import ModelConfig

# what a metainfer server's /v1/models card says of its model, checked against the roofline's config
CARD_FACTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_experts")


@dataclass(frozen=True)
class RooflineSpec:
    model: str | None = None  # `dummy:PATH`, a dir or config file; None: the full Qwen3.6 config
    dtype: str = "bfloat16"
    lm_head_dtype: str | None = None
    bandwidth: float = DEFAULT_BANDWIDTH_TB_S


def roofline_omitted(
    cfg: ModelConfig, path: Any, bandwidth: float, card: dict[str, Any] | None
) -> str | None:
    """Why the roofline says nothing of this server (None: it applies, as far as the server says)."""
    card = card or {}
    device = card.get("device")
    if isinstance(device, str) and device.split(":")[0].strip().lower() == "cpu":
        return f"the server runs on the CPU, and the roofline assumes {gpu_label(bandwidth)}"
    for key in CARD_FACTS:
        served = card.get(key)
        if isinstance(served, int) and not isinstance(served, bool) and served != getattr(cfg, key):
            return (
                f"the served model has {key} {served}, not {getattr(cfg, key)}: it is not "
                f"{model_label(path)}, the model the roofline assumes (--config names the served model's)"
            )
    return None


def roofline_figures(
    spec: RooflineSpec,
    m: ServeMetrics,
    reqs: Sequence[SampleRequest],
    server_card: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list[tuple[str, Any] | str]]:
    """(figures for the JSON, lines for the table: a title naming what the roofline assumes, then
    labelled rows; or one line saying why it is omitted, with `omitted` in the figures)."""
    cfg, path = load_config(spec.model)
    label = assumption_label(path, spec.dtype, spec.bandwidth, spec.lm_head_dtype)
    why = roofline_omitted(cfg, path, spec.bandwidth, server_card)
    if why is not None:
        return {"assumes": label, "config_path": str(path), "omitted": why}, [f"Roofline omitted: {why}"]
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
        "assumes": label,
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
    served_on = (server_card or {}).get("device")
    title = f"Roofline {label}" + (f" (server: {served_on})" if isinstance(served_on, str) else "")
    lines: list[tuple[str, Any] | str] = [
        f"{' ' + title + ' ':-^50}",
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
    server_card: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], str, ServeRun]:
    """Runs one serving benchmark; returns (result object, printed table, raw run). `server_card`:
    the server's /v1/models entry (asked for here when None and a roofline is wanted)."""
    if reqs is None:
        from metainfer.tokenizer import load_tokenizer

        reqs = load_requests(dataset, load_tokenizer(tokenizer_dir))
    result = run(client, reqs)
    m = result.metrics
    fig: dict[str, Any] | None = None
    lines: list[tuple[str, Any] | str] = []
    if roofline is not None:
        if server_card is None:
            import asyncio

            from metainfer.bench.client import served_model_card

            server_card = asyncio.run(served_model_card(client.base_url)) or {}
        fig, lines = roofline_figures(roofline, m, reqs, server_card)
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
