"""gemv_e4m3_pre_gdn's schedule (mega/gemv.cu: the DeltaNet decode step in the in_proj's launch), on the CPU.

The kernel's chunk order and arrival counts are written out here as the CUDA code computes them
(`chunk_at`, `gdn_arrive`), and checked with the launcher's parameters (`gemv.gdn_schedule`): every chunk is
taken once, the updater CTAs (h < hv) take `waves` chunks at most, each head's count reaches GDN_ROWS (else
CTA h would wait until the kernel's watchdog traps), and every head's rows are in the chunks of the first
`waves` rounds, so the updaters do not wait on the last ones. Where nvcc is, the same rules (and the experts'
down runs') are checked on gemv.cu's own schedule functions, compiled into a host program
(gemv_schedule_check.cu). The kernels themselves run in tests/gpu/test_gemv_gpu.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from metainfer.kernels.mega import gemv

D = gemv.GDN_D


def _layout(hk: int, hv: int) -> tuple[int, int, int]:
    """The DeltaNet in_proj's rows [q | k | v | z | b | a] -> (rows, b_off, a_off)."""
    b_off = (2 * hk + 2 * hv) * D
    return b_off + 2 * hv, b_off, b_off + hv


def _chunk_at(k: int, b: int, grid: int, n_chunks: int, hv: int, waves: int) -> int:  # gemv.cu's chunk_at
    c = b + k * grid
    if k >= waves:
        if b < hv:
            return -1
        c = waves * grid + (b - hv) + (k - waves) * (grid - hv)
    return c if c < n_chunks else -1


def _heads_rows(r0: int, hk: int, hv: int, b_off: int, a_off: int) -> list[int]:  # gemv.cu's gdn_arrive
    rows = gemv.CHUNK_ROWS

    def overlap(a: int, n: int) -> int:
        return max(0, min(a + n, r0 + rows) - max(a, r0))

    out = []
    for h in range(hv):
        kh = h // (hv // hk)
        out.append(overlap(kh * D, D) + overlap((hk + kh) * D, D) + overlap((2 * hk + h) * D, D)
                   + overlap(b_off + h, 1) + overlap(a_off + h, 1))
    return out


def _awaited(r0: int, hk: int, hv: int, b_off: int, a_off: int) -> bool:  # gemv.cu's gdn_awaited
    r1 = r0 + gemv.CHUNK_ROWS
    return r0 < (2 * hk + hv) * D or (r0 < b_off + hv and b_off < r1) or (r0 < a_off + hv and a_off < r1)


@pytest.mark.parametrize("hk,hv,grid", [(16, 32, 132), (4, 8, 132), (4, 8, 40), (16, 32, 33), (4, 8, 9)])
def test_every_chunk_once_and_every_head_complete(hk, hv, grid):
    n_rows, b_off, a_off = _layout(hk, hv)
    assert n_rows % gemv.CHUNK_ROWS == 0 and hv < grid  # what wanted_gdn asks of a layout
    n_chunks = n_rows // gemv.CHUNK_ROWS
    grid = min(grid, n_chunks)
    rot, waves = gemv.gdn_schedule(n_rows, grid, hv, hk, b_off)
    assert rot == b_off // gemv.CHUNK_ROWS
    taken: list[int] = []
    per_cta = []
    for b in range(grid):
        ks = []
        k = 0
        while (c := _chunk_at(k, b, grid, n_chunks, hv, waves)) >= 0:
            ks.append(c)
            k += 1
        assert all(_chunk_at(j, b, grid, n_chunks, hv, waves) < 0 for j in range(k, k + 50))  # a prefix
        per_cta.append(ks)
        taken += ks
    assert sorted(taken) == list(range(n_chunks))
    assert all(len(ks) <= waves for ks in per_cta[:hv])
    counts = [0] * hv
    first_rounds = [0] * hv
    unawaited = 0
    for c in taken:
        p = (c + rot) % n_chunks
        heads = _heads_rows(p * gemv.CHUNK_ROWS, hk, hv, b_off, a_off)
        for h, n in enumerate(heads):
            counts[h] += n
            if c < waves * grid:
                first_rounds[h] += n
        awaited = _awaited(p * gemv.CHUNK_ROWS, hk, hv, b_off, a_off)
        assert awaited or sum(heads) == 0, p  # a chunk whose warpgroup skips the count holds no head's rows
        unawaited += not awaited
    assert counts == [gemv.GDN_ROWS] * hv
    assert first_rounds == [gemv.GDN_ROWS] * hv  # every head's rows in the first `waves` rounds
    assert unawaited == hv * D // gemv.CHUNK_ROWS  # the z rows' chunks skip the fence and barrier


def test_model_schedule_and_override(monkeypatch):
    """The model's in_proj (12,352 rows) on the H200's 132 SMs: b/a first (chunk 768), 4 rounds on every CTA
    (q, k, v are virtual chunks 4-515); METAINFER_WGMMA_GEMV_GDN_WAVES moves the rounds for A/Bs."""
    n_rows, b_off, _ = _layout(16, 32)
    assert n_rows == 12352 and gemv.gdn_schedule(n_rows, 132, 32, 16, b_off) == (768, 4)
    monkeypatch.setenv(gemv.GDN_WAVES_ENV, "6")
    assert gemv.gdn_schedule(n_rows, 132, 32, 16, b_off) == (768, 6)
    monkeypatch.setenv(gemv.GDN_WAVES_ENV, "0")
    with pytest.raises(ValueError, match="GDN_WAVES"):
        gemv.gdn_schedule(n_rows, 132, 32, 16, b_off)


def test_not_wanted_on_the_cpu_or_off(monkeypatch):
    hk, hv = 16, 32
    n_rows, b_off, a_off = _layout(hk, hv)
    conv = (torch.zeros((2 * hk + hv) * D, 4, dtype=torch.bfloat16), None, torch.zeros(1, dtype=torch.long),
            torch.ones(1, dtype=torch.bool))
    args = (n_rows, conv, torch.zeros(hv), torch.zeros(hv), torch.zeros(2, hv, D, D),
            torch.zeros(hv, dtype=torch.int32), hk, hv, b_off, a_off)
    monkeypatch.delenv(gemv.GDN_ENV, raising=False)
    assert not gemv.gdn_enabled() and not gemv.wanted_gdn(*args)  # off by default until measured
    monkeypatch.setenv(gemv.GDN_ENV, "1")
    assert gemv.gdn_enabled() and not gemv.wanted_gdn(*args)  # CPU tensors


# ---- the same rules on gemv.cu's own functions, compiled into a host program (where nvcc is) ----
CHECK_SRC = Path(__file__).with_name("gemv_schedule_check.cu")


@pytest.fixture(scope="module")
def schedule_check(tmp_path_factory):
    """gemv_schedule_check.cu built for the host (it includes gemv.cu: chunk_of, chunks_of, gdn_rows and
    down_run are __host__ __device__)."""
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on this machine")
    exe = tmp_path_factory.mktemp("gemv") / "gemv_schedule_check"
    mega = Path(gemv.__file__).parent
    res = subprocess.run(["nvcc", "-O1", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", f"-I{mega}",
                          "-o", str(exe), str(CHECK_SRC)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]

    def run(*args) -> str:
        out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=60)
        return out.stdout.strip()

    return run


def _awaited(r0: int, hk: int, hv: int, b_off: int, a_off: int) -> bool:  # gemv.cu's gdn_awaited
    r1 = r0 + gemv.CHUNK_ROWS
    return r0 < (2 * hk + hv) * D or (r0 < b_off + hv and b_off < r1) or (r0 < a_off + hv and a_off < r1)


@pytest.mark.parametrize("hk,hv,grid", [(16, 32, 132), (4, 8, 132), (4, 8, 40), (16, 32, 33), (4, 8, 9)])
def test_cuda_schedule_gdn(schedule_check, hk, hv, grid):
    """gemv.cu's chunk_of / gdn_rows / chunks_of with gdn_schedule's parameters: every chunk once, every
    head's count GDN_ROWS, all within the first `waves` rounds, each updater's chunk count its ring index
    k0."""
    n_rows, b_off, a_off = _layout(hk, hv)
    grid = min(grid, n_rows // gemv.CHUNK_ROWS)
    rot, waves = gemv.gdn_schedule(n_rows, grid, hv, hk, b_off)
    assert schedule_check("gdn", n_rows, hk, hv, grid, b_off, a_off, rot, waves, 1) == "OK"


def test_cuda_schedule_gdn_catches_a_bad_order(schedule_check):
    """The check is not vacuous: without the rotation (b and a last) the heads' rows are not in the first 4
    rounds, and with 2 rounds not either, though every rule of correctness still holds."""
    n_rows, b_off, a_off = _layout(16, 32)
    model = ("gdn", n_rows, 16, 32, 132, b_off, a_off)
    assert schedule_check(*model, 0, 4, 1).startswith("FAIL a head's rows")
    assert schedule_check(*model, 768, 2, 1).startswith("FAIL a head's rows")
    assert schedule_check(*model, 768, 2, 0) == "OK"


@pytest.mark.parametrize("top_k,grid", [(8, 132), (5, 132), (8, 60), (3, 7)])
def test_cuda_schedule_down(schedule_check, top_k, grid):
    """moe_gate_up_down_e4m3's runs (down_run) partition the down chunks in order, each CTA's gate/up count
    (chunks_of) is where its run starts in the ring, and each pair gets its 64 gate/up chunks."""
    assert schedule_check("down", top_k, 1024, 32, grid) == "OK"


def test_ring_slots_even_only(monkeypatch):
    """gemv.cu's two warpgroups take alternate chunks: with an odd ring a slot's next chunk would be the other
    warpgroup's, which could pass its mbarrier wait a phase early (a review found it; 3 and 5 slots had been
    measured, KB-0106). The launcher refuses odd rings before nvcc runs."""
    monkeypatch.delenv(gemv.SLOTS_ENV, raising=False)
    assert gemv.ring_slots() == 4
    monkeypatch.setenv(gemv.SLOTS_ENV, "6")
    assert gemv.ring_slots() == 6
    for bad in ("3", "5", "8"):
        monkeypatch.setenv(gemv.SLOTS_ENV, bad)
        with pytest.raises(ValueError, match="SLOTS"):
            gemv.ring_slots()


def test_watchdog_report_names_the_wait(monkeypatch):
    """gemv.cu's watchdog writes [code, CTA, thread, saw, needed, kernel] into pinned host memory before it
    traps; watchdog_report turns that into a line (the kernels themselves: tests/gpu)."""
    from types import SimpleNamespace

    monkeypatch.setattr(gemv, "_KERNELS", {})
    assert gemv.watchdog_report() is None
    watch = torch.zeros(8, dtype=torch.int32)
    monkeypatch.setattr(gemv, "_KERNELS", {torch.device("cuda", 0): SimpleNamespace(watch=watch), "x": None})
    assert gemv.watchdog_report() is None  # nothing recorded
    watch[:6] = torch.tensor([1, 7, 0, 300, 386, 1], dtype=torch.int32)
    report = gemv.watchdog_report()
    assert "CTA 7" in report and "gemv_e4m3_pre_gdn" in report and "saw 300, needed 386" in report
    watch[:6] = torch.tensor([2, 3, 128, 5, 1, 0], dtype=torch.int32)
    assert "a full ring slot" in gemv.watchdog_report() and "chunk 5" in gemv.watchdog_report()


def test_router_fusion_not_wanted_on_the_cpu_or_off(monkeypatch):
    """KB-0111's switch is off by default and the CPU never takes it (the kernel: tests/gpu)."""
    x = torch.zeros(1, gemv.K, dtype=torch.bfloat16)
    nw = torch.zeros(gemv.K, dtype=torch.bfloat16)
    rw = torch.zeros(257, gemv.K, dtype=torch.bfloat16)
    w = torch.zeros(257, 128, 16, dtype=torch.float8_e4m3fn)  # (the shapes are not reached on the CPU)
    s = torch.zeros(257, 1, 1)
    monkeypatch.delenv(gemv.ROUTER_ENV, raising=False)
    assert not gemv.wanted_moe_router(x, x, nw, rw, 8, w, s)
    monkeypatch.setenv(gemv.ROUTER_ENV, "1")
    assert not gemv.wanted_moe_router(x, x, nw, rw, 8, w, s)  # a CPU tensor


def test_moe_ring_slots(monkeypatch):
    """The experts' own ring (KB-0113) follows METAINFER_WGMMA_GEMV_SLOTS unless set; even only."""
    monkeypatch.delenv(gemv.SLOTS_ENV, raising=False)
    monkeypatch.delenv(gemv.MOE_SLOTS_ENV, raising=False)
    assert gemv.moe_ring_slots() == 4
    monkeypatch.setenv(gemv.SLOTS_ENV, "6")
    assert gemv.moe_ring_slots() == 6
    monkeypatch.setenv(gemv.MOE_SLOTS_ENV, "2")
    assert gemv.moe_ring_slots() == 2
    monkeypatch.setenv(gemv.MOE_SLOTS_ENV, "5")
    with pytest.raises(ValueError, match="MOE_SLOTS"):
        gemv.moe_ring_slots()


def test_bf16_weights_wanted_only_with_their_switch(monkeypatch):
    """KB-0114: gemv.cu takes bf16 weights (no scales, N a multiple of 8) only with
    METAINFER_WGMMA_GEMV_BF16=1, and never on the CPU; e4m3 weights still need their scales (the kernel
    itself: tests/gpu)."""
    x = torch.zeros(1, gemv.K, dtype=torch.bfloat16)
    w16 = torch.zeros(1032, gemv.K, dtype=torch.bfloat16)
    w8 = torch.zeros(1024, gemv.K, dtype=torch.float8_e4m3fn)
    monkeypatch.delenv(gemv.BF16_ENV, raising=False)
    assert not gemv.wanted(x, w16, None) and not gemv.wanted(x, w8, None)
    monkeypatch.setenv(gemv.BF16_ENV, "1")
    assert not gemv.wanted(x, w16, None)  # a CPU tensor
    from metainfer.kernels import moe

    logits = torch.zeros(1, 41, dtype=torch.bfloat16)
    experts = torch.zeros(41, 128, gemv.K, dtype=torch.bfloat16)
    assert not gemv.wanted_moe(x, logits, 5, experts, None)
    assert not moe.routed_rows_bf16_ok(x, logits, 5, True, experts)  # (then moe_rows, as before)
