"""metainfer.bench.critical_path: exposed times of overlapping (PDL) kernels add up to the wall time."""

from __future__ import annotations

import random

import pytest

from metainfer.bench.critical_path import GAP, compact_timeline, device_intervals, exposed_table


def _by_name(rows):
    return {r["kernel"]: r for r in rows}


def test_serial_kernels_are_exposed_for_their_durations_and_gaps_are_counted():
    rows = _by_name(exposed_table([("a", 0, 3), ("b", 3, 5), ("a", 7, 8)], steps=1))
    assert rows["a"]["exposed_us_per_step"] == 4 and rows["a"]["calls_per_step"] == 2
    assert rows["b"]["exposed_us_per_step"] == 2
    assert rows[GAP]["exposed_us_per_step"] == 2  # 5 -> 7


def test_an_early_started_kernel_is_exposed_only_past_its_predecessor():
    """PDL: b starts at 1 (while a runs until 4) and ends at 6: 2 exposed, 5 busy."""
    rows = _by_name(exposed_table([("b", 1, 6), ("a", 0, 4)], steps=1))
    assert rows["a"]["exposed_us_per_step"] == 4
    assert rows["b"]["exposed_us_per_step"] == 2 and rows["b"]["busy_us_per_step"] == 5
    assert GAP not in rows


def test_a_kernel_covered_by_another_is_not_exposed():
    """A side-stream copy (1, 2) inside a (0, 5): exposed 0; c after both."""
    rows = _by_name(exposed_table([("a", 0, 5), ("copy", 1, 2), ("c", 4, 9)], steps=1))
    assert rows["copy"]["exposed_us_per_step"] == 0
    assert rows["a"]["exposed_us_per_step"] == 5 and rows["c"]["exposed_us_per_step"] == 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exposed_times_sum_to_the_span(seed):
    """Random overlapping chains over 3 steps: exposed + gaps = (last end - first start) / steps, each
    row's exposed time within its busy time."""
    rng = random.Random(seed)
    ivs, t = [], 0.0
    for i in range(300):
        start = t + rng.uniform(-3, 2)  # before the previous end (PDL) or after a gap
        end = max(start, t) + rng.uniform(0.1, 5)
        ivs.append((f"k{i % 7}", start, end))
        t = end
    rows = exposed_table(ivs, steps=3)
    span = max(e for _, _, e in ivs) - min(s for _, s, _ in ivs)
    assert sum(r["exposed_us_per_step"] for r in rows) == pytest.approx(span / 3)
    for r in rows:
        if r["kernel"] != GAP:
            assert -1e-9 <= r["exposed_us_per_step"] <= r["busy_us_per_step"] + 1e-9
    assert [r["exposed_us_per_step"] for r in rows] == sorted((r["exposed_us_per_step"] for r in rows),
                                                              reverse=True)


def test_device_intervals_keep_device_events_only():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(name, dev, s, e):
        return SimpleNamespace(name=name, device_type=dev, time_range=SimpleNamespace(start=s, end=e))

    evs = [ev("k", DeviceType.CUDA, 1, 3), ev("cpu_op", DeviceType.CPU, 0, 9),
           ev("empty", DeviceType.CUDA, 4, 4)]
    assert device_intervals(evs) == [("k", 1.0, 3.0)]


def test_compact_timeline_keeps_the_intervals_in_start_order():
    tl = compact_timeline([("b", 11.004, 15.0), ("a", 10.0, 12.5), ("b", 16.0, 17.0)])
    assert tl["names"] == ["a", "b"]
    assert tl["events"] == [[0, 0.0, 2.5], [1, 1.0, 5.0], [1, 6.0, 7.0]]
    assert compact_timeline([]) == {"names": [], "events": []}
