"""metainfer.bench.critical_path: exposed times of overlapping (PDL) kernels add up to the wall time."""

from __future__ import annotations

import random

import pytest

from metainfer.bench.critical_path import (
    GAP,
    compact_timeline,
    device_intervals,
    exposed_table,
    launch_overhead,
    layer_table,
)


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


def _layers(kinds, steps=3, t0=0.0):
    """A PDL-chained timeline of `steps` steps: a step's head (its inputs: "embed"), then one period a layer
    (the previous layer's "down", the mixer's kernels, "gate_up"), then "lm_head"; each kernel starts 1 µs
    before the one before it ends. -> (compact timeline, {kind: the period's kernels, exposed µs})."""
    mixers = {"deltanet": [("in_proj", 9.0), ("gdn", 4.0)],
              "attention": [("qkv", 7.0), ("_decode_split_kernel", 6.0), ("o_proj", 7.0)]}
    def layer(kind):
        return [("down", 5.0), *mixers[kind], ("router", 2.0), ("gate_up", 9.0)]

    ivs, t = [], t0
    for _ in range(steps):
        for name, d in [("embed", 2.0)] + [k for kind in kinds for k in layer(kind)] + [("lm_head", 240.0)]:
            ivs.append((name, t - 1.0, t + d))
            t += d
        t += 30.0  # between steps: the host
    want = {kind: layer(kind) for kind in set(kinds)}
    return compact_timeline(ivs), want


def test_layer_table_splits_the_step_into_layers():
    """Each layer's period ends with its gate/up and holds the previous layer's down; the kinds apart (by
    the attention split kernel); a step's first period (its head) and the tail after the last gate/up are
    left out; the medians are the kernels' exposed times."""
    kinds = ["deltanet", "deltanet", "deltanet", "attention"] * 4
    timeline, want = _layers(kinds)
    table = layer_table(timeline)
    assert set(table) == {"deltanet", "attention"}
    assert table["deltanet"]["periods"] == 3 * 11 and table["attention"]["periods"] == 3 * 4  # 1 a step out
    for kind, rows in want.items():
        got = [(r["kernel"], r["exposed_us"]) for r in table[kind]["kernels"]]
        assert got == [(n, pytest.approx(x)) for n, x in rows], kind
        assert table[kind]["period_us"] == pytest.approx(sum(x for _, x in rows))
        assert all(r["calls"] == 1 for r in table[kind]["kernels"])


def test_layer_table_counts_a_gap_inside_a_period():
    """A gap between two kernels of a layer is a GAP row of that layer (and the kernel after it, no longer
    overlapping the one before, is exposed for its whole interval)."""
    timeline, _ = _layers(["deltanet"] * 6, steps=2)
    names, events = timeline["names"], timeline["events"]
    gdn = names.index("gdn")
    shifted, late = [], 0.0
    for i, s, e in events:  # every gdn starts 2 µs after the in_proj ends: a 2 µs gap, everything after later
        if i == gdn:
            late += 3.0
        shifted.append([i, s + late, e + late])
    rows = {r["kernel"]: r for r in layer_table({"names": names, "events": shifted})["deltanet"]["kernels"]}
    assert rows[GAP]["exposed_us"] == pytest.approx(2.0) and rows["gdn"]["exposed_us"] == pytest.approx(5.0)


def test_layer_floor_bytes_of_the_model():
    """The full config's per-layer bytes, written out by hand (FP8 batch 1, 1,024 tokens of context):
    DeltaNet in_proj 12,352 x 2,048, out_proj 4,096 x 2,048, the BF16 router 257 x 2,048 x 2, 9 experts'
    gate/up and down 9 x 3 x 512 x 2,048, the fp32 state 32 x 128 x 128 x 4 read and written, the conv
    state 3 x 8,192 x 2 read and written; attention qkv 9,216 x 2,048, o_proj 4,096 x 2,048, the router,
    the experts and the KV cache 1,024 x 2 x 256 x 2 x 2. BF16 doubles the projections and experts."""
    from metainfer.bench.critical_path import layer_floor_bytes
    from metainfer.config import FULL_CONFIG, ModelConfig

    cfg = ModelConfig.from_hf(FULL_CONFIG)
    router, experts = 257 * 2048 * 2, 9 * 3 * 512 * 2048
    deltanet = 12352 * 2048 + 4096 * 2048 + router + experts + 32 * 128 * 128 * 4 * 2 + 3 * 8192 * 2 * 2
    attention = 9216 * 2048 + 4096 * 2048 + router + experts + 1024 * 2 * 256 * 2 * 2
    assert layer_floor_bytes(cfg, True, 1024) == {"deltanet": deltanet, "attention": attention}
    bf16 = layer_floor_bytes(cfg, False, 1024)
    assert bf16["deltanet"] == deltanet + 12352 * 2048 + 4096 * 2048 + experts
    assert deltanet / 4.3e6 == pytest.approx(15.66, abs=0.01)  # µs at 4.3 TB/s


def test_launch_overhead_counts_kernels_only():
    exposed = [{"kernel": "gemv_e4m3_pre", "calls_per_step": 39.0}, {"kernel": GAP, "calls_per_step": 0.0},
               {"kernel": "Memset (Device)", "calls_per_step": 2.0},
               {"kernel": "_gdn_decode_kernel", "calls_per_step": 30.0},
               {"kernel": "Memcpy HtoD (Pinned -> Device)", "calls_per_step": 1.0}]
    o = launch_overhead(exposed, step_us=1660.0, floor_us=845.0)
    assert o["launches"] == 69 and o["over_floor_us"] == 815.0 and abs(o["us_per_launch"] - 815 / 69) < 1e-9
    assert launch_overhead([], 10.0, 5.0)["us_per_launch"] == 0.0
