"""The roofline byte-count tables as markdown (`metainfer bench roofline --markdown`).

benchmarks/README.md embeds this output for the full config; a test keeps the two in sync.
"""

from __future__ import annotations

from metainfer.bench.roofline import (
    CONV_STATE_BYTES,
    STATE_BYTES,
    decode_ceiling,
    prefill_floor,
    step_cost,
    weight_tensors,
)
from metainfer.config import ModelConfig

PRECISIONS = (  # (label, weights dtype, lm_head dtype)
    ("BF16", "bfloat16", "bfloat16"),
    ("FP8, BF16 lm_head", "fp8", "bfloat16"),
    ("all FP8", "fp8", "fp8"),
)


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


def tensor_table(cfg: ModelConfig) -> list[str]:
    dense, expert = weight_tensors(cfg)
    k = cfg.num_experts_per_tok
    rows = [
        "| tensor | shape [out, in] | copies | params (M) | BF16 (MB) | FP8 (MB) |",
        "|---|---|---|---:|---:|---:|",
    ]
    for t in dense:
        rows.append(
            f"| {t.name} | [{t.rows}, {t.cols}] | {t.copies} | {t.params / 1e6:,.2f} "
            f"| {_mb(t.nbytes('bfloat16'))} | {_mb(t.nbytes('fp8'))} |"
        )
    for t in expert:
        rows.append(
            f"| routed {t.name} × top-{k} | [{t.rows}, {t.cols}] | {t.copies}×{k} "
            f"| {k * t.params / 1e6:,.2f} | {_mb(k * t.nbytes('bfloat16'))} | {_mb(k * t.nbytes('fp8'))} |"
        )
    rows.append(
        f"| embedding row | [1, {cfg.hidden_size}] | 1 | {cfg.hidden_size / 1e6:.3f} "
        f"| {_mb(2 * cfg.hidden_size)} | {_mb(2 * cfg.hidden_size)} |"
    )
    nl, hv = len(cfg.linear_layer_ids), cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    state = nl * hv * dk * dv * STATE_BYTES * 2
    conv = nl * cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) * CONV_STATE_BYTES * 2
    rows.append(
        f"| DeltaNet state, fp32, read + write | [{hv}, {dk}, {dv}] | {nl}×2 | — | {_mb(state)} "
        f"| {_mb(state)} |"
    )
    rows.append(
        f"| DeltaNet conv state, bf16, read + write | [{cfg.linear_conv_dim}, "
        f"{cfg.linear_conv_kernel_dim - 1}] | {nl}×2 | — | {_mb(conv)} | {_mb(conv)} |"
    )
    kv = len(cfg.full_layer_ids) * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    rows.append(
        f"| KV cache, bf16, per cached token | [2, {cfg.num_key_value_heads}, {cfg.head_dim}] "
        f"| {len(cfg.full_layer_ids)} | — | {kv / 1e3:.1f} kB | {kv / 1e3:.1f} kB |"
    )
    return rows


def summary_table(cfg: ModelConfig, bandwidth: float, design: dict[str, float] | None = None) -> list[str]:
    rows = ["| group | " + " | ".join(p[0] for p in PRECISIONS) + " |", "|---|" + "---:|" * len(PRECISIONS)]
    costs = [step_cost(cfg, "decode", dt, lm_head_dtype=lm) for _, dt, lm in PRECISIONS]
    params = dict(costs[0].params_by_group)
    for g, _ in costs[0].bytes_by_group:
        vals = [dict(c.bytes_by_group)[g] for c in costs]
        if max(vals) == 0:
            continue
        p = f" ({params[g] / 1e9:.3f} B params)" if params.get(g, 0) >= 1e6 else ""
        rows.append(f"| {g}{p} | " + " | ".join(f"{_mb(v)} MB" for v in vals) + " |")
    rows.append(
        "| **total per token** | " + " | ".join(f"**{c.total_bytes / 1e9:.3f} GB**" for c in costs) + " |"
    )
    ceils = [decode_ceiling(cfg, dt, 1, 0, bandwidth, lm) for _, dt, lm in PRECISIONS]
    rows.append(
        f"| **ceiling at {bandwidth:g} TB/s** | "
        + " | ".join(f"**{c.tok_s:,.0f} tok/s**" for c in ceils)
        + " |"
    )
    if design:
        rows.append("| docs/design.md §3 | " + " | ".join(f"~{design[p[0]]:,.0f}" for p in PRECISIONS) + " |")
    return rows


def concurrency_table(cfg: ModelConfig, bandwidth: float, context: int = 1024) -> list[str]:
    rows = [
        "| concurrency | experts read / layer | FP8 GB / step | FP8 ceiling tok/s | BF16 ceiling tok/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for c in (1, 8, 16, 32, 64):
        f8 = decode_ceiling(cfg, "fp8", c, context, bandwidth)
        bf = decode_ceiling(cfg, "bfloat16", c, context, bandwidth)
        rows.append(
            f"| {c} | {f8.cost.experts_per_layer:.1f} | {f8.cost.total_bytes / 1e9:.2f} "
            f"| {f8.tok_s:,.0f} | {bf.tok_s:,.0f} |"
        )
    return rows


def prefill_table(cfg: ModelConfig, bandwidth: float) -> list[str]:
    rows = ["| prompt | precision | GB read | TFLOP | floor (ms) | bound |", "|---:|---|---:|---:|---:|---|"]
    for n in (128, 1024, 8192):
        for label, dt, lm in PRECISIONS[:2]:
            p = prefill_floor(cfg, dt, n, bandwidth, lm)
            rows.append(
                f"| {n} | {label} | {p.cost.total_bytes / 1e9:.2f} | {p.cost.flops / 1e12:.2f} "
                f"| {p.step_time_s * 1e3:.2f} | {p.bound} |"
            )
    return rows


DESIGN_FIGURES = {"BF16": 720.0, "FP8, BF16 lm_head": 1210.0, "all FP8": 1430.0}


def markdown_tables(cfg: ModelConfig, bandwidth: float = 4.3, design: bool = True) -> str:
    parts = [
        "#### Weights and state read per decode step, batch 1, context 0",
        "",
        *tensor_table(cfg),
        "",
        "#### Per group and ceilings, batch 1, context 0",
        "",
        *summary_table(cfg, bandwidth, DESIGN_FIGURES if design else None),
        "",
        "#### Decode ceilings vs concurrency, context 1024 per sequence (FP8 with BF16 lm_head)",
        "",
        *concurrency_table(cfg, bandwidth),
        "",
        "#### Prefill floors, one prompt",
        "",
        *prefill_table(cfg, bandwidth),
    ]
    return "\n".join(parts) + "\n"
