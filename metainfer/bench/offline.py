"""`bench offline`: the engine's Python API (`metainfer.llm.LLM`) without HTTP.

What is timed (wall clock around `LLM.generate`, which returns finished token ids, so it includes
every device sync), for one batch of `batch_size` random prompts of `input_len` tokens, greedy,
`ignore_eos`:
- prefill_s: `generate(max_tokens=1)`: the batch's prefill plus one sampled token (= TTFT for all);
- total_s: `generate(max_tokens=output_len)`;
- decode_s = total_s - prefill_s: the remaining `output_len - 1` decode steps.
Each figure is the median over `num_iters` iterations, after `warmup` untimed calls.
decode tok/s = batch_size · (output_len - 1) / decode_s; TPOT = decode_s / (output_len - 1);
output throughput = batch_size · output_len / total_s; total = batch_size · (in + out) / total_s.
The roofline rows sit under a title naming the GPU, model and precision they assume; on a CPU run
they are omitted, with one line saying why.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from metainfer.bench.datasets import DatasetSpec, random_requests
from metainfer.bench.env import build_result
from metainfer.bench.roofline import (
    DEFAULT_BANDWIDTH_TB_S,
    assumption_label,
    decode_ceiling,
    gpu_label,
    load_config,
    prefill_floor,
)


@dataclass(frozen=True)
class OfflineConfig:
    model: str = ""  # dir, dummy:CONFIG, or "" for the default model
    input_len: int = 1024
    output_len: int = 128
    batch_size: int = 1
    num_iters: int = 3
    warmup: int = 1
    dtype: str = "bfloat16"  # bfloat16 | float32 | fp8 (FP8 weights, BF16 activations)
    device: str = "auto"  # auto | cpu | cuda[:N]
    seed: int = 0
    bandwidth: float = DEFAULT_BANDWIDTH_TB_S

    def __post_init__(self) -> None:
        if min(self.input_len, self.output_len, self.batch_size, self.num_iters) < 1:
            raise ValueError("input_len, output_len, batch_size and num_iters must be positive")
        if self.output_len < 2:
            raise ValueError("output_len must be >= 2 to separate decode from prefill")
        if self.dtype not in ("bfloat16", "float32", "fp8"):
            raise ValueError("dtype must be bfloat16, float32 or fp8")

    @property
    def roofline_dtype(self) -> str:
        return "fp8" if self.dtype == "fp8" else "bfloat16"


@dataclass(frozen=True)
class OfflineMetrics:
    prefill_s: float  # median
    total_s: float  # median
    decode_s: float
    prefill_runs_s: tuple[float, ...]
    total_runs_s: tuple[float, ...]
    decode_tok_s: float  # all sequences
    decode_tok_s_per_stream: float
    tpot_ms: float
    output_throughput: float
    total_token_throughput: float
    short_outputs: tuple[tuple[int, int], ...]  # (index, tokens) of outputs shorter than output_len

    def flat(self) -> dict[str, Any]:
        d = asdict(self)
        d["mean_ttft_ms"] = self.prefill_s * 1000.0
        d["mean_tpot_ms"] = self.tpot_ms
        d["num_short_outputs"] = len(self.short_outputs)
        return d


def default_llm_factory(cfg: OfflineConfig) -> Any:
    from metainfer.llm import LLM

    kw: dict[str, Any] = {
        "model": cfg.model,
        "dtype": "bfloat16" if cfg.dtype == "fp8" else cfg.dtype,
        "device": cfg.device,
        "max_num_seqs": cfg.batch_size,
        "max_model_len": cfg.input_len + cfg.output_len + 16,
    }
    if cfg.dtype == "fp8":
        kw["quantization"] = "fp8"
    return LLM(**kw)


def _sampling(max_tokens: int) -> Any:
    from metainfer.llm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _sync(device: str) -> None:
    if device != "cpu":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def run_offline(
    cfg: OfflineConfig,
    llm_factory: Callable[[OfflineConfig], Any] = default_llm_factory,
    sampling: Callable[[int], Any] = _sampling,
) -> OfflineMetrics:
    model_cfg, _ = load_config(cfg.model)
    spec = DatasetSpec(
        "random",
        cfg.input_len,
        cfg.output_len,
        cfg.batch_size,
        seed=cfg.seed,
        vocab_limit=model_cfg.vocab_size,
    )
    from metainfer.tokenizer import load_tokenizer

    prompts = [list(r.prompt_token_ids or ()) for r in random_requests(spec, load_tokenizer(None))]
    llm = llm_factory(cfg)

    def timed(max_tokens: int) -> tuple[float, list[Any]]:
        _sync(cfg.device)
        t = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sampling(max_tokens))
        _sync(cfg.device)
        return time.perf_counter() - t, list(outs)

    for _ in range(cfg.warmup):
        timed(1)
        timed(min(cfg.output_len, 8))
    pre_runs, tot_runs = [], []
    short: list[tuple[int, int]] = []
    for _ in range(cfg.num_iters):
        pre_runs.append(timed(1)[0])
        t, outs = timed(cfg.output_len)
        tot_runs.append(t)
        short = [(i, len(o.token_ids)) for i, o in enumerate(outs) if len(o.token_ids) < cfg.output_len]
    pre, tot = statistics.median(pre_runs), statistics.median(tot_runs)
    dec = max(tot - pre, 1e-9)
    steps = cfg.output_len - 1
    return OfflineMetrics(
        prefill_s=pre,
        total_s=tot,
        decode_s=dec,
        prefill_runs_s=tuple(pre_runs),
        total_runs_s=tuple(tot_runs),
        decode_tok_s=cfg.batch_size * steps / dec,
        decode_tok_s_per_stream=steps / dec,
        tpot_ms=1000.0 * dec / steps,
        output_throughput=cfg.batch_size * cfg.output_len / tot,
        total_token_throughput=cfg.batch_size * (cfg.input_len + cfg.output_len) / tot,
        short_outputs=tuple(short),
    )


def on_gpu(device: str) -> bool:
    """Whether the engine runs on a GPU: `cuda[:N]`, or `auto` with one present."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def offline_roofline(cfg: OfflineConfig, m: OfflineMetrics) -> dict[str, Any]:
    """The roofline figures; on a CPU run only what they would assume and why they are `omitted`."""
    model_cfg, path = load_config(cfg.model)
    label = assumption_label(path, cfg.roofline_dtype, cfg.bandwidth)
    if not on_gpu(cfg.device):
        why = f"a CPU run, and the roofline assumes {gpu_label(cfg.bandwidth)}"
        return {"assumes": label, "config_path": str(path), "omitted": why}
    ctx = cfg.input_len + cfg.output_len // 2
    dec = decode_ceiling(model_cfg, cfg.roofline_dtype, cfg.batch_size, ctx, cfg.bandwidth)
    fig: dict[str, Any] = {
        "assumes": label,
        "config_path": str(path),
        "dtype": cfg.roofline_dtype,
        "bandwidth_tb_s": cfg.bandwidth,
        "concurrency": cfg.batch_size,
        "context": ctx,
        "decode_ceiling_tok_s": dec.tok_s,
        "decode_pct_of_ceiling": 100.0 * m.decode_tok_s / dec.tok_s,
    }
    if cfg.batch_size == 1:
        pre = prefill_floor(model_cfg, cfg.roofline_dtype, cfg.input_len, cfg.bandwidth)
        fig["prefill_floor_ms"] = pre.step_time_s * 1000.0
        fig["prefill_floor_pct_of_prefill"] = 100.0 * pre.step_time_s / m.prefill_s
    return fig


def format_offline(cfg: OfflineConfig, m: OfflineMetrics, fig: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("Batch size:", cfg.batch_size),
        ("Input / output tokens:", f"{cfg.input_len} / {cfg.output_len}"),
        ("Iterations (median of):", cfg.num_iters),
        ("Prefill + 1 token (ms):", m.prefill_s * 1000.0),
        ("Whole generate (ms):", m.total_s * 1000.0),
        ("Decode time (ms):", m.decode_s * 1000.0),
        ("TPOT (ms):", m.tpot_ms),
        ("Decode tok/s (all sequences):", m.decode_tok_s),
        ("Decode tok/s per stream:", m.decode_tok_s_per_stream),
        ("Output token throughput (tok/s):", m.output_throughput),
        ("Total Token throughput (tok/s):", m.total_token_throughput),
    ]
    if m.short_outputs:
        rows.append(("Short outputs:", f"{len(m.short_outputs)}: {list(m.short_outputs)[:20]}"))
    roof: list[tuple[str, Any]] = []
    if "omitted" not in fig:
        roof = [
            (f"Decode ceiling, c={cfg.batch_size} (tok/s):", fig["decode_ceiling_tok_s"]),
            ("Decode % of ceiling:", fig["decode_pct_of_ceiling"]),
        ]
        if "prefill_floor_ms" in fig:
            roof.append(("Prefill floor (ms):", fig["prefill_floor_ms"]))

    def line(label: str, v: Any) -> str:
        return f"{label:<40} {(f'{v:.2f}' if isinstance(v, float) else v)!s:<10}"

    lines = [f"{' Offline Benchmark Result ':=^50}"] + [line(*r) for r in rows]
    if "omitted" in fig:
        lines.append(f"Roofline omitted: {fig['omitted']}")
    else:
        lines.append(f"{' Roofline ' + fig['assumes'] + ' ':-^50}")
        lines += [line(*r) for r in roof]
    lines.append("=" * 50)
    return "\n".join(lines)


def offline_benchmark(
    cfg: OfflineConfig,
    verdict: str | None = None,
    argv: list[str] | None = None,
    llm_factory: Callable[[OfflineConfig], Any] = default_llm_factory,
    sampling: Callable[[int], Any] = _sampling,
) -> tuple[dict[str, Any], str, OfflineMetrics]:
    m = run_offline(cfg, llm_factory, sampling)
    fig = offline_roofline(cfg, m)
    obj = build_result(
        kind="offline",
        engine="metainfer",
        workload=f"offline-b{cfg.batch_size}-{cfg.input_len}x{cfg.output_len}",
        config=asdict(cfg),
        metrics={**m.flat(), "max_concurrency": cfg.batch_size},
        roofline=fig,
        verdict=verdict,
        argv=argv,
    )
    return obj, format_offline(cfg, m, fig), m
