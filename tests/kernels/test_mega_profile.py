"""profile.py on a hand-built record (the layout mega_base.cuh's profiling build writes): the phases come out
of the cycle words modulo 2^32, the clock out of globaltimer, and the groups sum the instructions."""

from __future__ import annotations

import math

import pytest
import torch

from metainfer.kernels.mega import profile
from metainfer.kernels.mega import program as P


def _gemv(rows, k):
    w = torch.zeros(rows, k, dtype=torch.float8_e4m3fn)
    return P.Gemv(w, P.Vec(torch.zeros(k, dtype=torch.bfloat16)),
                  ws=torch.ones((rows + 127) // 128, k // 128))


def test_summarize_hand_built_record():
    instrs = [_gemv(256, 256), _gemv(256, 256), _gemv(128, 512)]
    grid, n = 2, 3
    buf = torch.zeros(profile.words(n, grid), dtype=torch.int64)
    rec = buf[: grid * n * profile.PF_N].view(grid, n, profile.PF_N)
    base = 2**32 - 550  # the cycle counter wraps inside the step
    for c in range(grid):
        t = base
        for i in range(n):  # 100 cycles staging, 300 more with 50 of them waiting for chunks
            rec[c, i, profile.C_IN] = t
            rec[c, i, profile.C_X] = t + 100
            rec[c, i, profile.C_OUT] = t + 400
            rec[c, i, profile.C_WAIT] = 50
            rec[c, i, profile.P_EMPTY] = 7
            rec[c, i, profile.CHUNKS] = 2
            t += 400
    t = buf[grid * n * profile.PF_N:].view(grid, 4)
    t[:, 0], t[:, 2] = 1000, 1000 + 600  # 1,200 cycles in 600 ns: 2 GHz
    buf = ((buf + 2**31) % 2**32 - 2**31).to(torch.int32)  # the kernel's int32 words
    s = profile.summarize(buf, instrs, grid)
    assert s["clock_ghz"] == pytest.approx(2.0)
    us = 1 / 2000  # one cycle at 2 GHz
    assert s["consumer_us"] == pytest.approx(3 * 400 * us)
    assert s["stage_us"] == pytest.approx(3 * 100 * us)
    assert s["chunk_wait_us"] == pytest.approx(3 * 50 * us)
    assert s["work_us"] == pytest.approx(3 * 250 * us)
    assert s["producer_empty_wait_us"] == pytest.approx(3 * 7 * us)
    g = {r["group"]: r for r in s["groups"]}
    assert g["Gemv 256x256 e4m3"]["instructions"] == 2 and g["Gemv 128x512 e4m3"]["instructions"] == 1
    assert g["Gemv 256x256 e4m3"]["consumer_us"] == pytest.approx(2 * 400 * us)
    assert g["Gemv 256x256 e4m3"]["chunks_per_cta"] == pytest.approx(4)
    assert "| all | 3 |" in profile.table(s)


def test_timeline_lines_the_ctas_up_on_globaltimer():
    """CTA 1 enters 0.5 us after CTA 0 (globaltimer) with its own cycle counter: on the common axis its
    events land 0.5 us later, and the table gives the CTAs' median (torch's: the lower middle one) and
    last."""
    instrs = [_gemv(256, 256), _gemv(256, 256)]
    grid, n = 2, 2
    buf = torch.zeros(profile.words(n, grid), dtype=torch.int64)
    rec = buf[: grid * n * profile.PF_N].view(grid, n, profile.PF_N)
    for c, base in enumerate((5_000, 2**32 - 100)):  # unrelated counters, one wrapping
        for i in range(n):
            rec[c, i, profile.C_IN] = (base + 2000 * i) % 2**32
            rec[c, i, profile.C_X] = (base + 2000 * i + 500) % 2**32
            rec[c, i, profile.C_OUT] = (base + 2000 * i + 2000) % 2**32
    t = buf[grid * n * profile.PF_N:].view(grid, 4)
    t[0, 0], t[0, 2] = 10_000, 12_000  # 4,000 cycles in 2,000 ns: 2 GHz
    t[1, 0], t[1, 2] = 10_500, 12_500
    buf = ((buf + 2**31) % 2**32 - 2**31).to(torch.int32)
    rows = profile.timeline(buf, instrs, grid)
    assert [r["instruction"] for r in rows] == [0, 1] and rows[0]["group"] == "Gemv 256x256 e4m3"
    assert rows[0]["in"] == pytest.approx((0.0, 0.5))
    assert rows[1]["x"] == pytest.approx((1.25, 1.75))  # 2,500 cycles = 1.25 us after each CTA's entry
    assert rows[1]["out"][1] == pytest.approx(2.5)
    assert "s1" not in rows[0]  # no marks recorded
    assert "| 1 | Gemv 256x256 e4m3 | 1.0 / 1.5 | 1.2 / 1.8 |" in profile.timeline_table(rows)


def test_routing_marks_against_the_routers_last_exit():
    """One router (instruction 0, run by CTA 0 only) and its GateUp (instruction 1, routed by both CTAs'
    producers): the producers' marks come out as microseconds after the router's last CTA out, their
    medians (torch's lower middle) and the slowest, on the common axis; no marks -> nan."""
    router = P.Gemv(torch.zeros(9, 256, dtype=torch.bfloat16), P.Vec(torch.zeros(256, dtype=torch.bfloat16)))
    gu = P.GateUp(torch.zeros(9, 32, 256, dtype=torch.float8_e4m3fn), torch.ones(9, 1, 2),
                  P.Vec(torch.zeros(256, dtype=torch.bfloat16)), P.Src(0), torch.zeros(256), P.Src(0), 2)
    instrs = [router, gu]
    grid, n = 2, 2
    buf = torch.zeros(profile.words(n, grid), dtype=torch.int64)
    rec = buf[: grid * n * profile.PF_N].view(grid, n, profile.PF_N)
    for c in range(grid):  # both counters from 0 at entry; 2 GHz (below)
        rec[c, 0, profile.C_IN] = 0
        rec[c, 1, profile.C_OUT] = 8000
    rec[0, 0, profile.C_OUT], rec[0, 0, profile.CHUNKS] = 2000, 1  # the router's one CTA out at 1 us
    rec[1, 0, profile.C_OUT] = 100  # (CTA 1: no router chunk)
    for c, (settled, end) in enumerate(((3000, 4000), (3400, 5000))):
        rec[c, 1, profile.P_IN] = 1000
        rec[c, 1, profile.P_ROUTE] = end - 1000  # (the routing's cycles from the producer's entry)
        rec[c, 1, profile.P_SETTLED] = settled
    t = buf[grid * n * profile.PF_N:].view(grid, 4)
    t[:, 0], t[:, 2] = 0, 4000  # 8,000 cycles in 4,000 ns: 2 GHz
    buf = ((buf + 2**31) % 2**32 - 2**31).to(torch.int32)
    r = profile.routing(buf, instrs, grid)
    assert r["layers"] == 1
    assert r["settled_us"] == pytest.approx(0.5)
    assert r["routed_us"] == pytest.approx(1.0) and r["routed_slowest_us"] == pytest.approx(1.5)
    assert r["router_exit_spread_us"] == pytest.approx(0.0)
    rec = buf[: grid * n * profile.PF_N].view(grid, n, profile.PF_N)
    rec[:, 1, profile.P_SETTLED] = 0  # (a build without the mark)
    assert math.isnan(profile.routing(buf, instrs, grid)["settled_us"])
