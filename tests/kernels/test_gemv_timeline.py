"""gemv_timeline.py's arithmetic on records built by hand (the kernel side: tests/gpu/test_gemv_gpu.py): the
field order against gemv_timeline.cuh's enum, each SM's clock fitted to globaltimer through coarse ticks,
the launches put back in order on one axis, and the summary table."""

from __future__ import annotations

import math
import re

import pytest
import torch

from metainfer.kernels.cuda import gemv_timeline as T
from metainfer.kernels.cuda import launch

GHZ = (1.98, 1.755)  # two SMs' clocks (cycles a ns)
CLK0 = (5_000_000_000, 700_000_000_000)  # their clock64 at the step's start (SMs' counters are not aligned)
GT0 = 1_764_000_000_000_000_000  # globaltimer (ns) at the step's start
TICK = 1000  # globaltimer's resolution in this test (ns): coarse, as on some GPUs


def test_fields_follow_the_header():
    """FIELDS is gemv_timeline.cuh's TL_* enum, in order (a word read under the wrong name would pass every
    other test here)."""
    src = (launch.HERE / "gemv_timeline.cuh").read_text()
    body = src[src.index("enum : int {"):src.index("TL_N\n")]
    names = [m.lower() for m in re.findall(r"^\s*TL_([A-Z0-9_]+),", body, flags=re.M)]
    assert tuple(n.replace("_", "") for n in names) == tuple(f.replace("_", "") for f in T.FIELDS)
    assert "gemv_timeline.cuh" in launch.SOURCES  # a change to it rebuilds the cubin


def _record(kind: int, n_rows: int, grid: int, cta: int, sm: int, seq: int,
            t_ns: dict[str, float]) -> list[int]:
    """One CTA's record: events at t_ns (ns from the step's start) on SM sm's clock, globaltimer ticks."""
    r = [0] * T.TL_N
    r[T.F["meta"]] = T.meta_word(kind, grid, cta, sm, n_rows)
    r[T.F["seq"]] = seq + 1
    for ev, t in t_ns.items():
        if ev in T.CYCLE_COUNTS:
            r[T.F[ev]] = round(t * GHZ[sm])
        else:
            r[T.F[ev]] = CLK0[sm] + round(t * GHZ[sm])
    r[T.F["gt_in"]] = GT0 + int(t_ns["in"] // TICK * TICK)
    r[T.F["gt_end0"]] = GT0 + int(t_ns["end0"] // TICK * TICK)
    return r


def _step(n_launches: int = 80) -> tuple[torch.Tensor, list[float]]:
    """A step of launches alternating the _pre projection (12,352 rows) and the experts' gate/up, 2 CTAs each
    on the two SMs (CTA 1 enters 0.3 us later), 20.37 us apart -> ([slots, grid, TL_N] records, starts ns)."""
    slots, grid = 128, 2
    buf = torch.zeros(slots, grid, T.TL_N, dtype=torch.int64)
    starts = []
    for k in range(n_launches):
        t0 = 1000.0 + k * 20_370.0
        starts.append(t0)
        pre = k % 2 == 0
        for cta in range(grid):
            e = t0 + 300.0 * cta
            ev = {"in": e, "wait": e + 2000, "staged": e + 2800, "x": e + 3100, "first": e + 3400,
                  "end0": e + 9000, "first1": e + 3500, "end1": e + 9500 + 100 * cta, "waitcyc0": 1500.0,
                  "waitcyc1": 1200.0, "p_last": e + 6000, "p_emptycyc": 2500.0}
            if pre:
                ev["rows"] = e + 2500
            else:
                ev["p_wait"] = e + 1500
            rec = _record(1 if pre else 2, 12352 if pre else 9216, grid, cta, cta, 3 + k, ev)
            buf[(3 + k) % slots, cta] = torch.tensor(rec)
    return buf, starts


def test_calibrate_fits_each_sm_through_coarse_ticks():
    buf, _ = _step()
    cal = T.calibrate(T._records(buf))
    assert sorted(cal) == [0, 1]
    for sm in (0, 1):
        a, c_ref, _b = cal[sm]
        assert a == pytest.approx(1 / GHZ[sm], rel=1e-3)


def test_decode_puts_the_launches_back_on_one_axis():
    buf, starts = _step()
    lns = T.decode(buf)
    assert [ln.seq for ln in lns] == list(range(3, 83))
    assert [ln.kind for ln in lns[:2]] == ["gemv_e4m3_pre", "moe_gate_up_e4m3"]
    assert lns[0].n_rows == 12352 and lns[1].n_rows == 9216 and lns[0].grid == 2
    for ln, t0 in zip(lns, starts):
        assert ln.t0_us - lns[0].t0_us == pytest.approx((t0 - starts[0]) / 1000, abs=0.05)
        assert ln.events["in"][1] == pytest.approx(0.3, abs=0.05)  # the SMs lined up within 50 ns
        assert ln.events["wait"][0] == pytest.approx(2.0, abs=0.05)
        assert ln.events["end"][1] == pytest.approx(0.3 + 9.6, abs=0.05)  # the later warpgroup's
        assert ln.waits["waitcyc0"][0] == pytest.approx(1.5, rel=1e-3)
    assert math.isnan(lns[1].events["rows"][0]) and not math.isnan(lns[0].events["rows"][0])


def test_summarize_and_table():
    buf, _ = _step()
    def label(ln, prev):
        return "in_proj" if ln.kind == "gemv_e4m3_pre" else T.default_label(ln, prev)

    lns = T.decode(buf)
    rows = T.summarize([lns[:40], lns[40:]], label)
    by = {r["name"]: r for r in rows}
    assert set(by) == {"in_proj", "moe_gate_up_e4m3 9216 rows"}
    r = by["in_proj"]
    assert r["launches"] == 40
    assert r["span_us"] == pytest.approx(9.9, abs=0.05)
    assert r["x_med_us"] == pytest.approx(3.25, abs=0.05) and r["x_last_us"] == pytest.approx(3.4, abs=0.05)
    assert r["gap_before_us"] == pytest.approx(20.37 - 9.9, abs=0.05)  # since the gate/up's last end
    assert r["between_us"] == pytest.approx(20.37 - 9.9 + 2.15, abs=0.05)  # to the median CTA's wait
    assert r["after_wait_us"] == pytest.approx((9.5 + 9.9) / 2 - 2.15, abs=0.05)
    assert r["rows_med_us"] == pytest.approx(2.65, abs=0.05)
    assert math.isnan(by["moe_gate_up_e4m3 9216 rows"]["rows_med_us"])
    text = T.table(rows)
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "in_proj" in lines[2] and "3.25 / 3.40" in lines[2]


def test_empty_buffer_decodes_to_nothing():
    assert T.decode(torch.zeros(4, 2, T.TL_N, dtype=torch.int64)) == []
