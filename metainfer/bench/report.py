"""`bench report`: result JSONs -> a markdown table, ratios vs a baseline engine, PNG plots.

Plots (matplotlib, Agg): decode tok/s per stream and mean TTFT per workload (bars per engine), and
output throughput vs concurrency (one line per engine and kind).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Row:
    engine: str
    kind: str  # serve | offline
    workload: str
    concurrency: int
    input_len: int
    output_len: int
    output_tok_s: float
    decode_tok_s: float  # per stream (1 / TPOT)
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    roofline_pct: float  # decode as % of the decode ceiling
    failed: int
    short: int
    verdict: str  # "pass" | "FAIL" | "-"
    source: str
    roofline_assumes: str = ""  # the GPU / model / precision of the ceiling (older results: "")
    roofline_omitted: str = ""  # why there is no roofline figure (a CPU run, another model)


def _num(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    return v


def load_results(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Result objects from files and directories (every *.json in them that has a `kind`)."""
    out = []
    for p in map(Path, paths):
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        for f in files:
            try:
                obj = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(obj, dict) and obj.get("kind") in ("serve", "offline"):
                obj["_source"] = str(f)
                out.append(obj)
    return out


def to_row(r: dict[str, Any]) -> Row:
    m, cfg = r.get("metrics") or {}, r.get("config") or {}
    roof = r.get("roofline") or {}
    if r["kind"] == "serve":
        ds = cfg.get("dataset") or {}
        in_len, out_len = int(ds.get("input_len", 0)), int(ds.get("output_len", 0))
        conc = int(m.get("max_concurrency") or cfg.get("num_requests") or 0)
    else:
        in_len, out_len = int(cfg.get("input_len", 0)), int(cfg.get("output_len", 0))
        conc = int(cfg.get("batch_size", 1))
    v = r.get("verdict") or {}
    verdict = "-" if not v else ("pass" if v.get("passed") is True else "FAIL")
    return Row(
        engine=str(r.get("engine", "?")),
        kind=r["kind"],
        workload=str(r.get("workload", "?")),
        concurrency=conc,
        input_len=in_len,
        output_len=out_len,
        output_tok_s=_num(m.get("output_throughput")),
        decode_tok_s=_num(m.get("decode_tok_s_per_stream")),
        mean_ttft_ms=_num(m.get("mean_ttft_ms")),
        p99_ttft_ms=_num(m.get("p99_ttft_ms")),
        mean_tpot_ms=_num(m.get("mean_tpot_ms")),
        roofline_pct=_num(roof.get("decode_pct_of_ceiling")),
        failed=int(m.get("failed") or 0),
        short=int(m.get("num_short_outputs") or 0),
        verdict=verdict,
        source=str(r.get("_source", "")),
        roofline_assumes=str(roof.get("assumes") or ""),
        roofline_omitted=str(roof.get("omitted") or ""),
    )


def _f(x: float, digits: int = 1) -> str:
    return "—" if math.isnan(x) else f"{x:,.{digits}f}"


def _ratio(a: float, b: float) -> str:
    return "—" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.2f}×"


def pick_baseline(rows: Sequence[Row], baseline: str | None) -> str | None:
    engines = list(dict.fromkeys(r.engine for r in rows))
    if baseline:
        return baseline if baseline in engines else None
    if "vllm" in engines:
        return "vllm"
    return engines[0] if len(engines) > 1 else None


def markdown(rows: Sequence[Row], baseline: str | None) -> str:
    # the roofline column names what it assumes: in its head when every figure assumes the same, else
    # in each cell; a result without a figure says why under the table
    assumed = {r.roofline_assumes for r in rows if not r.roofline_omitted and not math.isnan(r.roofline_pct)}
    one = len(assumed) == 1 and "" not in assumed
    roof_head = f"% roofline {next(iter(assumed))}" if one else "% roofline"
    head = (
        "| workload | engine | kind | conc | in/out | out tok/s | decode tok/s/stream | mean TTFT ms "
        f"| p99 TTFT ms | mean TPOT ms | {roof_head} | failed | short | verdict |"
    )
    lines = ["# Benchmark report", "", head, "|" + "---|" * 14]

    def roof_cell(r: Row) -> str:
        if one or not r.roofline_assumes or math.isnan(r.roofline_pct):
            return _f(r.roofline_pct)
        return f"{_f(r.roofline_pct)} ({r.roofline_assumes})"

    for r in sorted(rows, key=lambda r: (r.workload, r.engine, r.kind)):
        lines.append(
            f"| {r.workload} | {r.engine} | {r.kind} | {r.concurrency} | {r.input_len}/{r.output_len} "
            f"| {_f(r.output_tok_s)} | {_f(r.decode_tok_s)} "
            f"| {_f(r.mean_ttft_ms, 2)} | {_f(r.p99_ttft_ms, 2)} "
            f"| {_f(r.mean_tpot_ms, 3)} | {roof_cell(r)} | {r.failed} | {r.short} | {r.verdict} |"
        )
    omitted = [r for r in rows if r.roofline_omitted]
    if omitted:
        lines += [""] + [
            f"Roofline omitted for {r.engine} / {r.workload}: {r.roofline_omitted}"
            for r in sorted(omitted, key=lambda r: (r.workload, r.engine, r.kind))
        ]
    if baseline:
        lines += [
            "",
            f"## Ratios vs {baseline}",
            "",
            "Throughput and decode: this / baseline (higher is better); TTFT: this / baseline "
            "(lower is better).",
            "",
            "| workload | engine | out tok/s × | decode × | TTFT × |",
            "|---|---|---|---|---|",
        ]
        base = {(r.workload, r.kind): r for r in rows if r.engine == baseline}
        for r in sorted(rows, key=lambda r: (r.workload, r.engine)):
            b = base.get((r.workload, r.kind))
            if r.engine == baseline or b is None:
                continue
            lines.append(
                f"| {r.workload} | {r.engine} | {_ratio(r.output_tok_s, b.output_tok_s)} "
                f"| {_ratio(r.decode_tok_s, b.decode_tok_s)} | {_ratio(r.mean_ttft_ms, b.mean_ttft_ms)} |"
            )
    bad = [r for r in rows if r.failed or r.short]
    if bad:
        lines += ["", "## Problems", ""]
        lines += [
            f"- {r.engine} / {r.workload}: {r.failed} failed, {r.short} short outputs ({r.source})"
            for r in bad
        ]
    lines += ["", "Sources:", ""] + [f"- {r.source}" for r in rows if r.source]
    return "\n".join(lines) + "\n"


def _bars(ax: Any, rows: Sequence[Row], value: str, ylabel: str) -> None:
    workloads = list(dict.fromkeys(r.workload for r in rows))
    engines = list(dict.fromkeys(r.engine for r in rows))
    width = 0.8 / max(1, len(engines))
    for j, e in enumerate(engines):
        ys = []
        for w in workloads:
            vals = [getattr(r, value) for r in rows if r.engine == e and r.workload == w]
            ys.append(vals[0] if vals and not math.isnan(vals[0]) else 0.0)
        ax.bar([i + j * width for i in range(len(workloads))], ys, width, label=e)
    ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(workloads))], workloads, rotation=20)
    ax.set_ylabel(ylabel)
    ax.legend()


def plots(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for value, ylabel, fname in (
        ("decode_tok_s", "decode tok/s per stream", "decode_tok_s.png"),
        ("mean_ttft_ms", "mean TTFT (ms)", "ttft_ms.png"),
    ):
        sel = [r for r in rows if not math.isnan(getattr(r, value))]
        if not sel:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        _bars(ax, sel, value, ylabel)
        ax.set_title(ylabel)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        files.append(out_dir / fname)
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.output_len > 1 and not math.isnan(r.output_tok_s):
            series.setdefault(f"{r.engine} ({r.kind})", []).append((r.concurrency, r.output_tok_s))
    if series:
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ticks = sorted({c for pts in series.values() for c, _ in pts})
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tok/s")
        ax.set_title("output throughput vs concurrency")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "throughput_vs_concurrency.png", dpi=110)
        plt.close(fig)
        files.append(out_dir / "throughput_vs_concurrency.png")
    return files


def write_report(
    paths: Iterable[str | Path], out_dir: str | Path, baseline: str | None = None
) -> tuple[Path, list[Path]]:
    """Writes report.md and the PNGs into out_dir; returns (markdown path, plot paths)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [to_row(r) for r in load_results(paths)]
    if not rows:
        raise ValueError("no serve/offline result JSON found")
    base = pick_baseline(rows, baseline)
    md = out / "report.md"
    pngs = plots(rows, out)
    text = markdown(rows, base)
    text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n"
    md.write_text(text)
    return md, pngs
