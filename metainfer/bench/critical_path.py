"""Where a decode step's wall time goes when its kernels overlap (programmatic dependent launch).

With PDL each kernel starts while the one before it still runs and waits on the device for it, so the
profiler's per-kernel durations overlap and sum to far more than the step (FP8 batch 1 on the H200:
2.98 ms of kernel time in a 1.76 ms step, 2026-12-04f). The step is a chain: each kernel ends after
the one before it. Sorted by end time, kernel i adds `end_i - max(end_{i-1}, start_i)` to the wall
time: the part of it that nothing else covers, its *exposed* time. A stretch in which no kernel runs
(the host or a launch between graphs) is a gap. Exposed times plus gaps add up to the span from the
first kernel's start to the last kernel's end, so the table answers "which kernel's tail does the
step wait on" where the durations cannot.

`exposed_table(intervals, steps)` aggregates per kernel name: calls, exposed and busy (duration)
microseconds per step; `compact_timeline` keeps the intervals themselves. Intervals come from the
profiler's device events (start, end in µs).
"""

from __future__ import annotations

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
