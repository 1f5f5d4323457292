"""The megakernel's programs on the CPU (metainfer/kernels/mega/program.py): the packed table holds each
field where mega.cu's `Instr` reads it, the checks refuse what the kernel cannot run, tagged words
round-trip, the float64 GEMV of the emulator is the block-scaled product, and program.py's constants
are mega.cu's (its parts: launch.SOURCES, every .cu and .cuh file beside it)."""

from __future__ import annotations

import dataclasses
import re
import struct
from pathlib import Path

import pytest
import torch

from metainfer.kernels import reference as ref
from metainfer.kernels.mega import emulate
from metainfer.kernels.mega import program as P

MEGA = Path(P.__file__).parent


def _e4m3(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(*shape, generator=g) * 2).to(torch.float8_e4m3fn)
    ws = 0.5 + 1.5 * torch.rand(*shape[:-2], (shape[-2] + 127) // 128, shape[-1] // 128, generator=g)
    return w, ws


def _bf16(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _moe(E=6, H=2048, I=512, top_k=2):
    """router -> GateUp -> Down on a Vec residual stream h and a mixer output (instruction 0)."""
    h = P.Vec(_bf16(H, seed=2))
    wm, sm = _e4m3(H, 512, seed=3)
    mix = P.Gemv(wm, P.Vec(_bf16(512, seed=4)), ws=sm)
    router = P.Gemv(_bf16(E + 1, H, seed=5) * 0.05, h, norm_w=_bf16(H, seed=6) * 0.1, add=P.Src(0))
    wgu, sgu = _e4m3(E + 1, 2 * I, H, seed=7)
    wdn, sdn = _e4m3(E + 1, H, I, seed=8)
    gu = P.GateUp(wgu, sgu, h, P.Src(0), router.norm_w, P.Src(1), top_k)
    dn = P.Down(wdn, sdn, P.Src(2), P.Src(1), h, P.Src(0), top_k)
    return [mix, router, gu, dn]


def _halves(word: int) -> tuple[int, int]:
    u = word & (2**64 - 1)
    return u & 0xFFFFFFFF, u >> 32


def _float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def test_table_holds_each_field_where_the_kernel_reads_it():
    instrs = _moe()
    prog = P.Program(instrs)
    t = prog.table.tolist()
    assert prog.table.shape == (4, P.WORDS) and P.WORDS * 8 == 160
    mix, router, gu, dn = instrs
    # word 0: op | output kind; words 1-6: ints; word 7: floats; words 8-19: pointers
    ops = [P.OP_GEMV, P.OP_GEMV, P.OP_GATE_UP, P.OP_DOWN]
    assert [_halves(t[i][0]) for i in range(4)] == [(op, P.OUT_BF16) for op in ops]
    ints = [[v for w in t[i][1:7] for v in _halves(w)] for i in range(4)]
    assert ints[0][:8] == [P.W_E4M3, 2048, 512, P.PRO_NONE, P.OUT_BF16, P.X_VEC, 0, 0]
    assert ints[1][:10] == [P.W_BF16, 7, 2048, P.PRO_ADD_RMSNORM, P.OUT_BF16, P.X_VEC, 0, 0, 0, 0]
    assert ints[2][:10] == [6, 512, 2048, 2, 1, P.X_VEC, 0, 0, 0, 0]
    assert ints[3] == [6, 512, 2048, 2, 1, P.X_VEC, 0, 0, 2, 0, 0, 0]
    assert _float(_halves(t[1][7])[0]) == pytest.approx(1e-6)
    ptrs = [t[i][8:] for i in range(4)]
    assert ptrs[0][:5] == [mix.w.data_ptr(), mix.ws.data_ptr(), 0, mix.x.t.data_ptr(), prog.y[0].data_ptr()]
    assert ptrs[1][1] == 0 and ptrs[1][2] == router.norm_w.data_ptr()
    assert ptrs[1][8] == prog.step_inputs.data_ptr()
    assert ptrs[2][:5] == [gu.w.data_ptr(), gu.ws.data_ptr(), gu.norm_w.data_ptr(), gu.x.t.data_ptr(),
                           prog.y[2].data_ptr()]
    assert ptrs[3][3] == dn.res.t.data_ptr() and ptrs[3][4] == prog.y[3].data_ptr()
    assert [y.numel() for y in prog.y] == [2048, 7, 3 * 512, 2048]
    assert prog.bytes == 2048 * 512 + 7 * 2048 * 2 + 3 * (1024 * 2048 + 2048 * 512)


def _bad(case):
    w, ws = _e4m3(64, 2048)
    x = P.Vec(_bf16(2048))
    good = P.Gemv(w, x, ws=ws)
    if case == "k":
        w3, s3 = _e4m3(64, 768)
        return [P.Gemv(w3, P.Vec(_bf16(768)), ws=s3)]
    if case == "row_bytes":  # 1,536-byte rows do not divide the slot
        w3, s3 = _e4m3(16, 1536)
        return [P.Gemv(w3, P.Vec(_bf16(1536)), ws=s3)]
    if case == "scales":
        return [P.Gemv(w, x, ws=ws[:, :3])]
    if case == "forward":
        return [P.Gemv(w, P.Src(1), ws=ws), good]
    if case == "slice":
        w5, s5 = _e4m3(8, 512)
        return [good, P.Gemv(w5, P.Src(0), ws=s5)]  # good has 64 rows < 512
    if case == "norm_fp32":
        w6, s6 = _e4m3(2048, 512)
        w7, s7 = _e4m3(8, 2048)
        first = P.Gemv(w6, P.Vec(_bf16(512)), ws=s6, out=P.OUT_F32)
        return [first, P.Gemv(w7, P.Src(0), ws=s7, norm_w=_bf16(2048))]
    if case == "dtype":
        return [P.Gemv(w.float(), x)]
    if case == "plain":
        return [P.Gemv(w, x, ws=ws, out=P.OUT_PLAIN_F32)]
    if case == "routing":  # Down's activations from a GateUp of another routing
        m = _moe()
        return [*m[:3], P.Down(m[3].w, m[3].ws, P.Src(2), P.Src(1), m[3].res, P.Src(0), top_k=3)]
    if case == "odd_offset":  # x staged in pairs of words (16-byte loads) from an odd offset
        wb, sb = _e4m3(1024, 2048)
        w8, s8 = _e4m3(8, 512)
        return [P.Gemv(wb, x, ws=sb), P.Gemv(w8, P.Src(0, off=1), ws=s8)]
    if case == "kv_block":  # a KV block of 12 positions (the kernel indexes blocks by shifts)
        wq, sq = _e4m3(2 * 2 * 256 + 2 * 256, 2048)
        cache = torch.zeros(4, 12, 1, 256, dtype=torch.bfloat16)
        attend = P.Attend(P.Src(0), cache, cache.clone(), _bf16(256), _bf16(256), torch.ones(32),
                          torch.zeros(4, dtype=torch.int32), hq=2, splits=1)
        return [P.Gemv(wq, x, ws=sq), attend]
    if case == "gated_head":  # a gated norm's head of 256 (the kernel keeps 2 pairs of norm weights a thread)
        return _gated(256)
    raise AssertionError(case)


def _gated(head_dim: int) -> list:
    """A DeltaNet out_proj: the gated norm of 4,096 core outputs (x) with z (add), heads of head_dim."""
    wz, sz = _e4m3(8192, 2048)
    wo, so = _e4m3(16, 4096)
    core = P.Gemv(wz, P.Vec(_bf16(2048)), ws=sz)
    return [core, P.Gemv(wo, P.Src(0), ws=so, add=P.Src(0, off=4096), gated=True, head_dim=head_dim,
                         norm_w=_bf16(head_dim))]


BAD = ["k", "row_bytes", "scales", "forward", "slice", "norm_fp32", "dtype", "plain", "routing", "odd_offset",
       "kv_block", "gated_head"]


@pytest.mark.parametrize("case", BAD)
def test_check_refuses_what_the_kernel_cannot_run(case):
    with pytest.raises(ValueError):
        P.Program(_bad(case))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_gated_heads_of_64_and_128_are_accepted(head_dim):
    assert len(P.Program(_gated(head_dim)).instrs) == 2


def test_tagged_words_round_trip():
    v32 = torch.randn(37)
    v16 = torch.randn(37).to(torch.bfloat16)
    w32, w16 = P.encode(v32, 5), P.encode(v16, 7)
    assert torch.equal(P.decode(w32, bf16=False), v32) and torch.equal(P.decode(w16, bf16=True), v16)
    assert torch.equal(w32 >> 32, torch.full((37,), 5)) and torch.equal(w16 >> 32, torch.full((37,), 7))


def test_emulated_gemv_is_the_block_scaled_product_of_the_normed_x():
    w, ws = _e4m3(300, 2048)
    nw = _bf16(2048, seed=9) * 0.1
    x = _bf16(2048, seed=10)
    g = P.Gemv(w, P.Vec(x), ws=ws, norm_w=nw, eps=1e-5, out=P.OUT_F32)
    got = emulate.gemv(g, [], torch.zeros(P.STEP_WORDS, dtype=torch.int64))
    xn = ref.rms_norm(x, nw, 1e-5).double()
    want = torch.zeros(300, dtype=torch.float64)
    for rb in range(3):
        for kb in range(16):
            blk = w[rb * 128 : (rb + 1) * 128, kb * 128 : (kb + 1) * 128].double()
            part = blk @ xn[kb * 128 : (kb + 1) * 128]
            want[rb * 128 : rb * 128 + blk.shape[0]] += float(ws[rb, kb]) * part
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-5)


def test_constants_are_mega_cu_s():
    from metainfer.kernels.mega.launch import MAINS, SOURCES

    parts = sorted(f.name for f in MEGA.iterdir() if f.suffix in (".cu", ".cuh"))
    assert sorted(set(SOURCES) | set(MAINS)) == parts  # every part is in the cubin cache's key (or is a main)
    src = "".join((MEGA / name).read_text() for name in SOURCES)

    def const(name):
        return int(re.search(rf"constexpr int {name} = (\d+);", src).group(1))

    names = ("NCW", "SLOT", "NSLOTS", "SCALE_BYTES", "KMAX", "SCRATCH", "MAX_SCORES", "MAX_EXPERTS",
             "ROUTE_WORDS")
    assert [const(n) for n in names] == [getattr(P, n) for n in names]
    assert "static_assert(sizeof(Instr) == 160" in src
    for name in ("OP_GEMV", "OP_GATE_UP", "OP_DOWN", "OP_DELTA", "OP_ATTEND", "OP_COMBINE", "PRO_GATED_NORM",
                 "OUT_PLAIN_F32", "EPI_CONV", "X_EMBED", "STEP_SEQ_LEN", "ERR_DATA", "ERR_FULL", "ERR_EMPTY"):
        assert re.search(rf"\b{name} = {getattr(P, name)}\b", src), name


def test_watchdog_words_read_as_a_diagnosis():
    prog = P.Program(_moe())
    assert prog.error() is None
    prog.state[2:6] = torch.tensor([P.ERR_DATA, 17, 3, 1234], dtype=torch.int32)
    assert prog.error() == "CTA 17 at instruction 3 (Down) polled an input that never came (element 1234)"
    prog.reset_error()
    assert prog.error() is None and prog.state.numel() == P.STATE_WORDS


def test_outputs_share_one_arena_with_aligned_disjoint_slices():
    prog = P.Program(_moe())
    starts = [y.data_ptr() for y in prog.y]
    assert all(y.untyped_storage().data_ptr() == prog.arena.untyped_storage().data_ptr() for y in prog.y)
    assert all(s % 16 == 0 for s in starts)
    spans = sorted((s, s + y.numel() * 8) for s, y in zip(starts, prog.y))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two outputs overlap
    assert [y.numel() for y in prog.y] == [g.rows for g in prog.instrs]
    apart = P.Program(_moe(), arena=False)  # one allocation each: the same table but the pointers
    assert [y.numel() for y in apart.y] == [y.numel() for y in prog.y] and not hasattr(apart, "arena")


def test_block_scales_must_start_16_byte_aligned():
    mix, router, gu, dn = _moe()
    ws = torch.empty(mix.ws.numel() + 1)[1:].view_as(mix.ws).copy_(mix.ws)  # 4 bytes off
    with pytest.raises(ValueError, match="16-byte aligned"):
        P.Program([dataclasses.replace(mix, ws=ws), router, gu, dn])
