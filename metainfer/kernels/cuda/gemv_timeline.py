"""Where a gemv.cu launch's time goes, CTA by CTA: the timeline build's records (`gemv_timeline.cuh`,
`gemv.use_timeline_build()`) read back and put on one time axis.

Each CTA of each launch writes TL_N 64-bit words: SM cycles (clock64) when it entered, when its
`griddepcontrol.wait` returned (the previous kernel done), when its x prologue had summed the MoE rows (the
`_pre` form), staged x in fp32 and then as e4m3 terms, when each warpgroup's first chunk was in and when it
was done, with the cycles it spent waiting for full slots; the producer's wait (the experts' routing) and
its last chunk's slot, with its cycles waiting for empty ones. Two globaltimer readings a CTA (entry, the
first warpgroup's end) tie the cycles to nanoseconds: `calibrate` fits each SM's clock to globaltimer over
all its records (a step's launches span milliseconds, so globaltimer's coarse ticks average out), which
lines the SMs up.

`Recorder(device)` points the records at a buffer (`[slots, grid, TL_N]`, a launch's place its sequence
number modulo slots, so one decode step's launches each get their own); `read()` returns it for `decode`,
`summarize` and `table`, which are arithmetic on the CPU (tests/kernels/test_gemv_timeline.py builds
records by hand). experiments/gemv_timeline.py runs it on the decode graph.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from metainfer.kernels.cuda import gemv

DEFINE = gemv.TIMELINE_DEFINE  # the timeline build's flag (gemv.use_timeline_build)
FIELDS = ("meta", "seq", "gt_in", "in", "wait", "rows", "staged", "x", "first", "end0", "waitcyc0", "gt_end0",
          "first1", "end1", "waitcyc1", "p_wait", "p_last", "p_emptycyc")  # gemv_timeline.cuh's TL_* order
TL_N = len(FIELDS)
F = {name: i for i, name in enumerate(FIELDS)}
KINDS = ("gemv_e4m3", "gemv_e4m3_pre", "moe_gate_up_e4m3")  # the meta word's kind
CLOCK_EVENTS = ("in", "wait", "rows", "staged", "x", "first", "end0", "first1", "end1", "p_wait", "p_last")
CYCLE_COUNTS = ("waitcyc0", "waitcyc1", "p_emptycyc")


def meta_word(kind: int, grid: int, cta: int, sm: int, n_rows: int) -> int:
    """gemv_timeline.cuh's TL_META packing (tests build records with it)."""
    return kind | grid << 4 | cta << 16 | sm << 28 | n_rows << 40


@dataclass(frozen=True)
class Launch:
    """One launch's CTAs on the step's time axis (µs from its first CTA's entry; NaN where a CTA did not
    record an event: the `_pre` rows in other kinds, say)."""

    seq: int
    kind: str
    n_rows: int
    grid: int
    t0_us: float  # its first CTA's entry, µs from the earliest record read
    events: dict[str, list[float]]  # event -> per CTA, µs from t0 ("end": the later warpgroup's)
    waits: dict[str, list[float]]  # CYCLE_COUNTS -> per CTA, µs

    @property
    def end_us(self) -> float:
        return self.t0_us + max(self.events["end"])


def _records(buf: torch.Tensor) -> torch.Tensor:
    """[n, TL_N] int64: the rows of buf ([slots, grid, TL_N] or [n, TL_N]) that hold a record."""
    rows = buf.detach().cpu().to(torch.int64).reshape(-1, TL_N)
    return rows[rows[:, F["seq"]] > 0]


def calibrate(rec: torch.Tensor) -> dict[int, tuple[float, int, float]]:
    """Per SM: (ns a cycle, the SM's reference cycle, ns at it from the earliest globaltimer reading), the
    least-squares line through its records' (clock64, globaltimer) pairs (entry, and the first warpgroup's
    end). An SM whose pairs span less than 10 µs takes the other SMs' median slope through its mean."""
    sm_of = (rec[:, F["meta"]] >> 28) & 0xFFF
    gt_ref = int(rec[:, F["gt_in"]].min())
    lines: dict[int, tuple[float, int, float]] = {}
    short: dict[int, tuple[int, float, float]] = {}  # SM -> (reference cycle, mean cycles, mean ns)
    for sm in sorted(set(sm_of.tolist())):
        r = rec[sm_of == sm]
        clk = torch.cat([r[:, F["in"]], r[:, F["end0"]]])
        gt = torch.cat([r[:, F["gt_in"]], r[:, F["gt_end0"]]])
        ok = (clk > 0) & (gt > 0)
        clk, gt = clk[ok], gt[ok]
        c_ref = int(clk.min())
        x = (clk - c_ref).double()  # exact int64 differences, then float (1.7e18 ns would lose 8 bits)
        y = (gt - gt_ref).double()
        xm, ym = float(x.mean()), float(y.mean())
        if len(x) < 3 or float(y.max() - y.min()) < 10_000:
            short[sm] = (c_ref, xm, ym)
            continue
        a = float(((x - xm) * (y - ym)).sum() / ((x - xm) ** 2).sum())
        lines[sm] = (a, c_ref, ym - a * xm)
    a_med = statistics.median(v[0] for v in lines.values()) if lines else 1 / 1.98  # (the H200's boost GHz)
    for sm, (c_ref, xm, ym) in short.items():
        lines[sm] = (a_med, c_ref, ym - a_med * xm)
    return lines


def decode(buf: torch.Tensor) -> list[Launch]:
    """The records in buf -> its launches in sequence order (`Launch`)."""
    rec = _records(buf)
    if len(rec) == 0:
        return []
    cal = calibrate(rec)
    meta = rec[:, F["meta"]]
    sm_of = ((meta >> 28) & 0xFFF).tolist()
    a = torch.tensor([cal[s][0] for s in sm_of], dtype=torch.float64)
    c_ref = torch.tensor([cal[s][1] for s in sm_of], dtype=torch.int64)
    b = torch.tensor([cal[s][2] for s in sm_of], dtype=torch.float64)
    times = {}  # event -> [n] µs from the earliest globaltimer reading (NaN: not recorded)
    for ev in CLOCK_EVENTS:
        clk = rec[:, F[ev]]
        t = (a * (clk - c_ref).double() + b) / 1000.0
        times[ev] = torch.where(clk > 0, t, torch.full_like(t, float("nan")))
    waits = {w: a * rec[:, F[w]].double() / 1000.0 for w in CYCLE_COUNTS}
    seqs = rec[:, F["seq"]] - 1
    out = []
    for seq in sorted(set(seqs.tolist())):
        ix = (seqs == seq).nonzero().flatten()
        m = int(meta[ix[0]])
        t0 = float(times["in"][ix].min())
        ev = {e: [float(v) - t0 for v in times[e][ix]] for e in CLOCK_EVENTS}
        # the later warpgroup's end (end1 NaN: a CTA with one warpgroup's chunks)
        ev["end"] = [max(e0, e1) if e1 == e1 else e0 for e0, e1 in zip(ev["end0"], ev["end1"])]
        out.append(Launch(seq=int(seq), kind=KINDS[m & 0xF] if (m & 0xF) < len(KINDS) else str(m & 0xF),
                          n_rows=m >> 40, grid=(m >> 4) & 0xFFF, t0_us=t0, events=ev,
                          waits={w: [float(v) for v in waits[w][ix]] for w in CYCLE_COUNTS}))
    return out


def _med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def _max(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return max(xs) if xs else float("nan")


SUMMARY_EVENTS = ("in", "wait", "rows", "staged", "x", "first", "end", "p_wait", "p_last")


def default_label(ln: Launch, prev: Launch | None) -> str:
    """A launch's group: its kernel and rows."""
    return f"{ln.kind} {ln.n_rows} rows"


def summarize(steps: list[list[Launch]],
              label: Callable[[Launch, Launch | None], str] = default_label) -> list[dict]:
    """Per launch group over the steps (each step's launches, `decode` of one read; `label` of each launch
    and the one before it in its step: by default its kernel and rows), the launches' medians of each
    event's median and last CTA (µs from the launch's first entry), of the span (first entry to last end),
    of the gap since the previous launch's last end to this one's first entry, and to its median CTA's wait
    (`between_us`: the kernels between them, as this launch saw them), of the median CTA's time from its
    wait to its end (`after_wait_us`: the launch's own time once its input is ready), and of the CTAs'
    median waits for full slots (each warpgroup's) and empty ones (the producer's)."""
    groups: dict[str, list[tuple[Launch, Launch | None]]] = {}
    for launches in steps:
        prev = None
        for ln in launches:
            groups.setdefault(label(ln, prev), []).append((ln, prev))
            prev = ln
    rows = []
    for name, lns in groups.items():
        first = lns[0][0]
        row = {"name": name, "kind": first.kind, "n_rows": first.n_rows, "launches": len(lns),
               "grid": first.grid, "span_us": _med([max(ln.events["end"]) for ln, _ in lns]),
               "gap_before_us": _med([ln.t0_us - p.end_us for ln, p in lns if p is not None]),
               "between_us": _med([ln.t0_us + _med(ln.events["wait"]) - p.end_us for ln, p in lns
                                   if p is not None]),
               "after_wait_us": _med([_med(ln.events["end"]) - _med(ln.events["wait"]) for ln, _ in lns])}
        for e in SUMMARY_EVENTS:
            row[f"{e}_med_us"] = _med([_med(ln.events[e]) for ln, _ in lns])
            row[f"{e}_last_us"] = _med([_max(ln.events[e]) for ln, _ in lns])
        for w in CYCLE_COUNTS:
            row[f"{w}_med_us"] = _med([_med(ln.waits[w]) for ln, _ in lns])
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """summarize's rows as a markdown table: the kernels between (the previous launch's end to this one's
    median wait), the median CTA's wait to end, then each event as median / last CTA, µs from the launch's
    first entry."""

    def f(x: float) -> str:
        return "-" if x != x else f"{x:.2f}"

    def pair(r: dict, e: str) -> str:
        return f"{f(r[e + '_med_us'])} / {f(r[e + '_last_us'])}"

    head = ("| launch | n | kernels between (to the wait) | wait to end | gap before | span | entry (last) "
            "| wait | rows summed | x fp32 | x e4m3 | first chunk | end | full-slot wait wg0 / wg1 "
            "| producer: wait, last slot, empty wait |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["name"], str(r["launches"]), f(r["between_us"]), f(r["after_wait_us"]),
                 f(r["gap_before_us"]), f(r["span_us"]), f(r["in_last_us"]),
                 *(pair(r, e) for e in ("wait", "rows", "staged", "x", "first", "end")),
                 f"{f(r['waitcyc0_med_us'])} / {f(r['waitcyc1_med_us'])}",
                 f"{pair(r, 'p_wait')}, {pair(r, 'p_last')}, {f(r['p_emptycyc_med_us'])}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


class Recorder:
    """The timeline build's records on `device` pointed at a buffer of `slots` launches (`read` after a
    step; `clear` before the next). The process's gemv.cu must be the timeline build:
    `gemv.use_timeline_build()` before gemv.cu loads (or `gemv.reset()` after)."""

    def __init__(self, device: torch.device, slots: int = 256) -> None:
        kernel = gemv._kernel(device)
        if kernel is None or not kernel.timeline_built:
            raise RuntimeError("gemv.cu is not the timeline build here: call gemv.use_timeline_build() "
                               "before it loads (or gemv.reset() after)")
        if kernel.timeline_words != TL_N:
            raise RuntimeError(f"gemv.cu's timeline records hold {kernel.timeline_words} words, "
                               f"gemv_timeline.py reads {TL_N}")
        self.kernel, self.slots, self.grid = kernel, slots, kernel.sms
        self.buf = torch.zeros(slots, self.grid, TL_N, dtype=torch.int64, device=device)
        kernel.set_timeline(self.buf, slots, self.grid)

    def clear(self) -> None:
        self.buf.zero_()

    def read(self) -> torch.Tensor:
        torch.cuda.synchronize(self.buf.device)
        return self.buf.cpu()

    def close(self) -> None:
        """Records off (the kernels write nothing)."""
        self.kernel.set_timeline(None)
        torch.cuda.synchronize(self.buf.device)
