"""Where a decode step's wall time goes when its kernels overlap (programmatic dependent launch).

With PDL each kernel starts while the one before it still runs and waits on the device for it, so the
profiler's per-kernel durations overlap and sum to far more than the step. The step is a chain: each
kernel ends after the one before it. Sorted by end time, kernel i adds `end_i - max(end_{i-1},
start_i)` to the wall time: the part of it that nothing else covers, its *exposed* time. A stretch in
which no kernel runs (the host or a launch between graphs) is a gap. Exposed times plus gaps add up to
the span from the first kernel's start to the last kernel's end, so the table answers "which kernel's
tail does the step wait on" where the durations cannot.

`exposed_table(intervals, steps)` aggregates per kernel name: calls, exposed and busy (duration)
microseconds per step; `compact_timeline` keeps the intervals themselves; `layer_table` splits a kept
timeline into layers (each ending with its experts' gate/up) and gives each kind of layer its median
exposed time per kernel, the view in which a fusion shows which part of a layer it took away. Intervals
come from the profiler's device events (start, end in µs). `python -m metainfer.bench.critical_path
decode_bench.json` prints the layer table of a decode_bench JSON's timeline.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections.abc import Iterable

GAP = "(no kernel running)"


def exposed_table(intervals: Iterable[tuple[str, float, float]], steps: int) -> list[dict]:
    """Per kernel name: calls_per_step, exposed_us_per_step (its share of the wall time, see the
    module doc), busy_us_per_step (its summed durations); a GAP row for the time no kernel covers.
    Rows by exposed time, largest first; their exposed times sum to the span / steps."""
    assert steps > 0, steps
    ivs = sorted((s, e, n) for n, s, e in intervals)
    rows: dict[str, dict] = {}

    def row(name: str) -> dict:
        return rows.setdefault(name, {"kernel": name, "calls": 0, "exposed": 0.0, "busy": 0.0})

    latest = None  # the latest end so far
    for start, end, name in ivs:
        assert end >= start, (name, start, end)
        r = row(name)
        r["calls"] += 1
        r["busy"] += end - start
        if latest is not None and start > latest:
            row(GAP)["exposed"] += start - latest
        r["exposed"] += max(0.0, end - max(start, latest if latest is not None else start))
        latest = end if latest is None else max(latest, end)
    out = [{"kernel": r["kernel"], "calls_per_step": r["calls"] / steps,
            "exposed_us_per_step": r["exposed"] / steps, "busy_us_per_step": r["busy"] / steps}
           for r in rows.values()]
    return sorted(out, key=lambda r: -r["exposed_us_per_step"])


def launch_overhead(exposed: list[dict], step_us: float, floor_us: float) -> dict:
    """The step's time past its byte floor, per kernel launch: the batch-1 step's fixed cost per launch,
    which fusions (fewer launches) and faster hand-offs (less a launch) each cut. exposed: an `exposed_table`
    (its kernels' calls a step; memcpys, memsets and gaps are not launches); step_us: the step's wall time;
    floor_us: its bytes at the bandwidth. -> {"launches", "over_floor_us", "us_per_launch"}"""
    launches = sum(r["calls_per_step"] for r in exposed
                   if r["kernel"] != GAP and not r["kernel"].startswith(("Memcpy", "Memset")))
    over = step_us - floor_us
    per = over / launches if launches else 0.0
    return {"launches": launches, "over_floor_us": over, "us_per_launch": per}


def compact_timeline(intervals: Iterable[tuple[str, float, float]], digits: int = 2) -> dict:
    """The intervals in start order, for offline study (which kernel waits on which): {"names": the
    distinct names, "events": [[name index, start, end], ...]} with times in µs from the first start,
    rounded to `digits`."""
    ivs = sorted(((s, e, n) for n, s, e in intervals))
    t0 = ivs[0][0] if ivs else 0.0
    names: dict[str, int] = {}
    events = [[names.setdefault(n, len(names)), round(s - t0, digits), round(e - t0, digits)]
              for s, e, n in ivs]
    return {"names": list(names), "events": events}


def device_intervals(events) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of the device-side events of a torch.profiler run's `events()`
    (kernels, memcpys, memsets)."""
    from torch.autograd import DeviceType

    out = []
    for ev in events:
        if getattr(ev, "device_type", None) == DeviceType.CUDA and ev.time_range.end > ev.time_range.start:
            out.append((ev.name[:90], float(ev.time_range.start), float(ev.time_range.end)))
    return out


def layer_table(timeline: dict, anchor: str = "gate_up", marker: str = "_decode_split") -> dict[str, dict]:
    """A `compact_timeline`'s kernels split into layer periods, each ending with a kernel whose name matches
    `anchor` (the experts' gate/up: one a layer, whatever else is fused around it) and running from the end
    of the one before: the previous layer's tail (its experts' down), then this layer's input projection,
    mixer, norm and router. A period holding a kernel that matches `marker` is an "attention" one, else
    "deltanet". -> {kind: {"periods": n, "period_us": median, "kernels": [{"kernel", "exposed_us": median
    over the periods, "calls": per period}, ...] in the order they end}}. Each kernel's exposed time is as in
    `exposed_table`; a gap inside a period is a GAP row. Periods holding a kernel seen in under a quarter of
    them are left out: a step's first (its inputs, the embedding, layer 0's plain projection) and those
    across the step boundary."""
    names = timeline["names"]
    periods: list[list[tuple[str, float]]] = []
    cur: list[tuple[str, float]] = []
    latest = None
    for idx, start, end in sorted(timeline["events"], key=lambda e: e[1]):
        name = names[idx]
        if latest is not None and start > latest:
            cur.append((GAP, start - latest))
        cur.append((name, max(0.0, end - max(start, latest if latest is not None else start))))
        latest = end if latest is None else max(latest, end)
        if re.search(anchor, name):
            periods.append(cur)
            cur = []
    seen_in: dict[str, int] = {}
    for p in periods:
        for n in {n for n, _ in p}:
            seen_in[n] = seen_in.get(n, 0) + 1
    regular = [p for p in periods if all(4 * seen_in[n] >= len(periods) for n, _ in p)]
    out: dict[str, dict] = {}
    for kind in ("deltanet", "attention"):
        group = [p for p in regular if any(re.search(marker, n) for n, _ in p) == (kind == "attention")]
        if not group:
            continue
        order: list[str] = []
        per: dict[str, list[float]] = {}
        calls: dict[str, int] = {}
        for p in group:
            total: dict[str, float] = {}
            for n, x in p:
                if n not in order:
                    order.append(n)
                total[n] = total.get(n, 0.0) + x
                calls[n] = calls.get(n, 0) + 1
            for n, x in total.items():
                per.setdefault(n, []).append(x)
        rows = [{"kernel": n, "exposed_us": statistics.median(per[n] + [0.0] * (len(group) - len(per[n]))),
                 "calls": calls[n] / len(group)} for n in order]
        period = statistics.median(sum(x for _, x in p) for p in group)
        out[kind] = {"periods": len(group), "period_us": period, "kernels": rows}
    return out


def layer_floor_bytes(cfg, fp8: bool, context: int) -> dict[str, float]:
    """The bytes one batch-1 decode step must move per layer of each kind (weights, state, KV cache; the
    activations are noise): {"deltanet": in_proj, out_proj, the router (BF16), the 8 routed and the shared
    experts' gate/up and down, the DeltaNet and conv states read and written; "attention": qkv, o_proj, the
    router, the experts, the KV cache of `context` tokens}. FP8: e4m3 projections and experts."""
    w = 1 if fp8 else 2
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    router = (cfg.num_experts + 1) * H * 2
    experts = (cfg.num_experts_per_tok + 1) * 3 * I * H * w
    in_proj = (cfg.linear_conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads) * H * w
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4 * 2
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim * 2 * 2
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {"deltanet": in_proj + cfg.linear_value_dim * H * w + router + experts + state + conv,
            "attention": ((2 * hq + 2 * hkv) * d * H + hq * d * H) * w + router + experts
            + context * hkv * d * 2 * 2}


def print_layer_table(table: dict[str, dict], floor_bytes: dict[str, float] | None = None,
                      tb_s: float | None = None) -> None:
    """`layer_table`'s rows; with floor_bytes (`layer_floor_bytes`) each kind's byte floor at tb_s TB/s
    (default: the roofline's bandwidth)."""
    from metainfer.bench.roofline import DEFAULT_BANDWIDTH_TB_S

    tb_s = tb_s or DEFAULT_BANDWIDTH_TB_S
    for kind, t in table.items():
        floor = ""
        if floor_bytes and kind in floor_bytes:
            f_us = floor_bytes[kind] / (tb_s * 1e6)
            floor = f", floor {f_us:.1f} us at {tb_s} TB/s ({100 * f_us / t['period_us']:.0f} %)"
        print(f"{kind} layers ({t['periods']} periods): {t['period_us']:.1f} us a layer (median){floor}, "
              "by kernel:")
        for r in t["kernels"]:
            print(f"  {r['exposed_us']:7.2f} us  x{r['calls']:<4.2g} {r['kernel'][:70]}")


if __name__ == "__main__":  # python -m metainfer.bench.critical_path decode_bench.json [anchor]
    import json

    from metainfer.config import ModelConfig

    res = json.load(open(sys.argv[1]))
    timeline = res.get("timeline_bs1")
    if timeline is None:
        sys.exit(f"{sys.argv[1]}: no batch-1 timeline (decode_bench's profile with PDL on keeps one)")
    floors = None
    try:  # the run's config, where this checkout has it (the JSON holds its path)
        floors = layer_floor_bytes(ModelConfig.from_hf(res["config"]), res["dtype"] == "fp8",
                                   res["decode"][0]["prompt_len"] + res["decode"][0]["gen"] // 2)
    except (KeyError, IndexError, OSError):
        pass
    print_layer_table(layer_table(timeline, *sys.argv[2:3]), floors)
