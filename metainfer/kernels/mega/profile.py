"""Where a megakernel step's time goes: the profiling build's records (mega_base.cuh, MEGA_PROF 1) read back.

Per CTA and instruction the kernel writes PF_N words of SM cycles (clock64's low 32 bits, so differences
are taken modulo 2^32): the consumers' entry, the moment x is staged (streaming ops), their exit, their
cycles waiting for weight chunks and the chunk count (consumer thread 0); the producer's entry, its routing
wait (with the L2 lead) and its waits for empty slots (producer lane 0). After them, per CTA, globaltimer
(ns) at entry and exit, which turns cycles into time and lines the CTAs up.

`summarize(buf, instrs, grid)` -> per instruction group (op and shape) the CTAs' mean cycles in each
phase, converted to microseconds, and the step's span. `timeline(buf, instrs, grid, lo, hi)` -> those
instructions' entry, x and exit on one time axis (the CTAs' median and last), which shows each hop.
Only arithmetic on the buffer: it runs on the CPU
from a saved record as well (tests/kernels/test_mega_profile.py builds one by hand).
"""

from __future__ import annotations

import math

import torch

from metainfer.kernels.mega import program as P

C_IN, C_X, C_OUT, C_WAIT, P_IN, P_ROUTE, P_EMPTY, CHUNKS, S1, S2, S3, S4, LAT = range(13)
P_SETTLED = 13  # (a routing's producer: its logits all loaded)
PF_N = 14


def words(n_instr: int, grid: int) -> int:
    """int32 words of a profile buffer for n_instr instructions on `grid` CTAs."""
    return grid * n_instr * PF_N + grid * 4


def label(g: P.Instr) -> str:
    """An instruction's group: its op and the shape that sets its cost."""
    if isinstance(g, P.Gemv):
        wt = "e4m3" if g.w.dtype == torch.float8_e4m3fn else "bf16"
        return f"Gemv {g.rows}x{g.k} {wt}"
    if isinstance(g, (P.GateUp, P.Down)):
        return type(g).__name__
    return type(g).__name__


def _u32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64) & 0xFFFFFFFF


def _delta(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(b - a) mod 2^32, int64."""
    return (_u32(b) - _u32(a)) & 0xFFFFFFFF


def summarize(buf: torch.Tensor, instrs: list[P.Instr], grid: int) -> dict:
    """The profile buffer (int32, words(len(instrs), grid)) -> a summary dict (see module docstring)."""
    n = len(instrs)
    buf = buf.detach().cpu().to(torch.int64)
    rec = buf[: grid * n * PF_N].view(grid, n, PF_N)
    t = _u32(buf[grid * n * PF_N : grid * n * PF_N + grid * 4].view(grid, 4))
    t_in, t_out = t[:, 0] | (t[:, 1] << 32), t[:, 2] | (t[:, 3] << 32)
    span_cycles = _delta(rec[:, 0, C_IN], rec[:, n - 1, C_OUT]).double()  # first entry to last exit, per CTA
    span_ns = (t_out - t_in).double()
    hz = float((span_cycles.sum() / span_ns.sum()) * 1e9) if float(span_ns.sum()) > 0 else float("nan")
    us = 1e6 / hz

    total = _delta(rec[:, :, C_IN], rec[:, :, C_OUT]).double()  # [grid, n]
    streaming = torch.tensor([isinstance(g, (P.Gemv, P.GateUp, P.Down)) for g in instrs])
    has_x = (rec[:, :, C_X] != 0) & streaming  # the op staged x (the CTA had units of it)
    stage = torch.where(has_x, _delta(rec[:, :, C_IN], rec[:, :, C_X]).double(), torch.zeros_like(total))
    wait = _u32(rec[:, :, C_WAIT]).double()
    route = _u32(rec[:, :, P_ROUTE]).double()
    empty = _u32(rec[:, :, P_EMPTY]).double()
    chunks = _u32(rec[:, :, CHUNKS]).double()
    lat = _u32(rec[:, :, LAT]).double()  # one L2 load's round trip at each op's entry

    phases = {"consumer_us": total, "stage_us": stage, "chunk_wait_us": wait, "work_us": total - stage - wait,
              "producer_route_us": route, "producer_empty_wait_us": empty}  # each [grid, n] cycles

    def mean_us(x: torch.Tensor, ix: torch.Tensor) -> float:  # the CTAs' mean of the summed cycles of ix
        return float(x[:, ix].sum(1).mean()) * us

    groups: dict[str, list[int]] = {}
    for i, g in enumerate(instrs):
        groups.setdefault(label(g), []).append(i)
    rows = []
    for name, idx in groups.items():
        ix = torch.tensor(idx)
        rows.append({"group": name, "instructions": len(idx),
                     "chunks_per_cta": float(chunks[:, ix].sum(1).mean()),
                     **{k: mean_us(v, ix) for k, v in phases.items()},
                     "load_latency_us": float(lat[:, ix].median()) * us})
    rows.sort(key=lambda r: -r["consumer_us"])
    every = torch.arange(n)
    return {"clock_ghz": hz / 1e9, "grid": grid, "instructions": n,
            "span_us_mean": float(span_ns.mean()) / 1e3, "span_us_all": float(t_out.max() - t_in.min()) / 1e3,
            **{k: mean_us(v, every) for k, v in phases.items()},
            "load_latency_us": float(lat.median()) * us, "groups": rows}


def timeline(buf: torch.Tensor, instrs: list[P.Instr], grid: int, lo: int = 0,
             hi: int | None = None) -> list[dict]:
    """Instructions [lo, hi) on one time axis: per instruction, the CTAs' entry, x staged and exit as
    microseconds since the first CTA entered the step (each CTA's cycles from its own entry, at the
    step's mean clock, plus its globaltimer entry), as the CTAs' median (the lower middle one) and the
    last CTA's; and the prologue marks S1-S4 where the op has them. The last CTA's exit of an op
    against the next op's x shows what a dependency hop costs."""
    n = len(instrs)
    hi = n if hi is None else hi
    buf = buf.detach().cpu().to(torch.int64)
    rec = buf[: grid * n * PF_N].view(grid, n, PF_N)
    t = _u32(buf[grid * n * PF_N : grid * n * PF_N + grid * 4].view(grid, 4))
    t_in = (t[:, 0] | (t[:, 1] << 32)).double()
    hz = summarize(buf, instrs, grid)["clock_ghz"] * 1e9
    start = (t_in - t_in.min()) / 1e3  # us: each CTA's entry on the common axis
    rows = []
    for i in range(lo, hi):
        row = {"instruction": i, "group": label(instrs[i])}
        marks = (("in", C_IN), ("x", C_X), ("s1", S1), ("s2", S2), ("s3", S3), ("s4", S4), ("out", C_OUT))
        for name, f in marks:
            if name == "x" and not isinstance(instrs[i], (P.Gemv, P.GateUp, P.Down)):
                continue  # (only the streaming ops stage an x)
            ok = rec[:, i, f] != 0  # (the CTAs that recorded it)
            if not bool(ok.any()):
                continue
            us = (_delta(rec[:, 0, C_IN], rec[:, i, f]).double() / hz * 1e6 + start)[ok]
            row[name] = (float(us.median()), float(us.max()))
        rows.append(row)
    return rows


def _axis_us(rec: torch.Tensor, t: torch.Tensor, hz: float, i: int, f: int) -> torch.Tensor:
    """Field f (absolute cycles) of instruction i per CTA, as microseconds on the step's common axis."""
    t_in = (t[:, 0] | (t[:, 1] << 32)).double()
    return _delta(rec[:, 0, C_IN], rec[:, i, f]).double() / hz * 1e6 + (t_in - t_in.min()) / 1e3


def routing(buf: torch.Tensor, instrs: list[P.Instr], grid: int) -> dict:
    """The routings' latency: per GateUp, its producers' marks against the last exit of its router's CTAs
    (the last logits stored), on the common time axis; the medians over the layers (us): the logits all
    loaded (nan where no producer marked it), the routing done (median and slowest producer), and how far
    apart the router's CTAs finished."""
    n = len(instrs)
    buf = buf.detach().cpu().to(torch.int64)
    rec = buf[: grid * n * PF_N].view(grid, n, PF_N)
    t = _u32(buf[grid * n * PF_N : grid * n * PF_N + grid * 4].view(grid, 4))
    hz = summarize(buf, instrs, grid)["clock_ghz"] * 1e9
    rows = []
    for i, g in enumerate(instrs):
        if not isinstance(g, P.GateUp):
            continue
        r = g.logits.index
        routed = rec[:, i, P_ROUTE] != 0  # (the producers that routed here)
        wrote = rec[:, r, CHUNKS] != 0  # (the router's CTAs)
        if not bool(routed.any()) or not bool(wrote.any()):
            continue
        exit_ = _axis_us(rec, t, hz, r, C_OUT)[wrote]
        last = float(exit_.max())
        end = (_axis_us(rec, t, hz, i, P_IN) + _u32(rec[:, i, P_ROUTE]).double() / hz * 1e6)[routed] - last

        ok = routed & (rec[:, i, P_SETTLED] != 0)
        at = _axis_us(rec, t, hz, i, P_SETTLED)[ok] - last
        settled = float(at.median()) if bool(ok.any()) else math.nan
        rows.append([settled, float(end.median()), float(end.max()), float(exit_.max() - exit_.min())])
    if not rows:
        return {}
    med = torch.tensor(rows).nanmedian(0).values.tolist()
    keys = ("settled_us", "routed_us", "routed_slowest_us", "router_exit_spread_us")
    return {"layers": len(rows), **dict(zip(keys, med))}


def timeline_table(rows: list[dict]) -> str:
    """timeline's rows as a markdown table (p50 / max of the CTAs, microseconds)."""
    cols = ("in", "x", "s1", "s2", "s3", "s4", "out")
    out = ["| # | group | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[c][0]:.1f} / {r[c][1]:.1f}" if c in r else "" for c in cols]
        out.append(f"| {r['instruction']} | {r['group']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def record(kernel, prog: P.Program, mma: bool = False, lead: int = 0, inflight: int = P.NSLOTS,
           launches: int = 3) -> torch.Tensor:
    """The profile buffer of the last of `launches` launches of prog on kernel (a MegaKernel(prof=True))."""
    buf = torch.zeros(words(len(prog.instrs), kernel.num_sms), dtype=torch.int32, device=kernel.device)
    for _ in range(launches):
        buf.zero_()
        kernel.launch(prog, lead=lead, mma=mma, inflight=inflight, prof=buf)
    torch.cuda.synchronize(kernel.device)
    return buf


COLUMNS = (("consumer_us", "consumer us"), ("stage_us", "stage x"), ("chunk_wait_us", "chunk waits"),
           ("work_us", "work"), ("producer_route_us", "producer route"),
           ("producer_empty_wait_us", "empty waits"))


def table(s: dict) -> str:
    """summarize's dict as a markdown table (microseconds per CTA, the CTAs' mean)."""
    head = ["group", "n", "chunks/CTA", *(c for _, c in COLUMNS), "L2 load us (median)"]
    out = [f"profile: {s['instructions']} instructions on {s['grid']} CTAs, "
           f"SM clock {s['clock_ghz']:.2f} GHz, "
           f"span {s['span_us_mean']:.1f} us per CTA ({s['span_us_all']:.1f} first entry to last exit)",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    total = {"group": "all", "instructions": s["instructions"], "chunks_per_cta": float("nan"),
             **{k: s[k] for k, _ in COLUMNS}, "load_latency_us": s["load_latency_us"]}
    for r in [*s["groups"], total]:
        cells = [r["group"], str(r["instructions"]), f"{r['chunks_per_cta']:.1f}",
                 *(f"{r[k]:.1f}" for k, _ in COLUMNS), f"{r['load_latency_us']:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
