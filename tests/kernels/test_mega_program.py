"""The megakernel's programs on the CPU (metainfer/kernels/mega/program.py): the packed table holds each
field where mega.cu's `Instr` reads it, the checks refuse what the kernel cannot run, tagged words
decode to their values, the float64 reference is the block-scaled product, and program.py's constants
are mega.cu's."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
import torch

from metainfer.kernels import reference as ref
from metainfer.kernels.mega import program as P

CU = Path(P.__file__).with_name("mega.cu")


def _e4m3(rows, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, k, generator=g) * 2).to(torch.float8_e4m3fn)
    ws = 0.5 + 1.5 * torch.rand((rows + 127) // 128, k // 128, generator=g)
    return w, ws


def _bf16(n, seed=1):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _chain():
    w0, s0 = _e4m3(1100, 2048)
    w1, s1 = _e4m3(520, 512, seed=2)
    w2 = _bf16(257 * 1024, seed=3).view(257, 1024)
    return [
        P.Gemv(w0, s0, x=_bf16(2048), norm_w=_bf16(2048, seed=4), eps=1e-5, out_bf16=True),
        P.Gemv(w1, s1, src=0, src_off=7),
        P.Gemv(w2, src=0, src_off=0, norm_w=_bf16(1024, seed=5)),
    ]


def _halves(word: int) -> tuple[int, int]:
    u = word & (2**64 - 1)
    return u & 0xFFFFFFFF, u >> 32


def test_table_holds_each_field_where_the_kernel_reads_it():
    prog = P.Program(_chain())
    t = prog.table.tolist()
    assert prog.table.shape == (3, P.WORDS) and prog.table.dtype == torch.int64
    g0, g1, g2 = prog.instrs
    assert _halves(t[0][0]) == (P.OP_GEMV, P.W_E4M3) and _halves(t[2][0]) == (P.OP_GEMV, P.W_BF16)
    assert _halves(t[0][1]) == (1100, 2048) and _halves(t[1][1]) == (520, 512)
    assert _halves(t[0][2]) == (P.PRO_RMSNORM, P.OUT_BF16) and _halves(t[1][2]) == (P.PRO_NONE, P.OUT_F32)
    src, eps_bits = _halves(t[0][3])
    assert src == 2**32 - 1 and struct.unpack("<f", struct.pack("<I", eps_bits))[0] == pytest.approx(1e-5)
    assert _halves(t[1][3])[0] == 0
    assert t[0][4:9] == [g0.w.data_ptr(), g0.ws.data_ptr(), g0.norm_w.data_ptr(), g0.x.data_ptr(),
                         prog.y[0].data_ptr()]
    assert t[2][5] == 0 and t[2][7] == 0  # no scales for bf16, no x with a source
    assert t[1][9] == 7 and t[1][10:] == [0, 0]
    assert prog.bytes == 1100 * 2048 + 520 * 512 + 257 * 1024 * 2
    assert [int(y.numel()) for y in prog.y] == [1100, 520, 257]
    assert all(int(y.abs().sum()) == 0 for y in prog.y)


def _bad(case):
    w, ws = _e4m3(64, 2048)
    x = _bf16(2048)
    good = P.Gemv(w, ws, x=x, out_bf16=True)
    if case == "k":
        w3, s3 = _e4m3(64, 768)
        return [P.Gemv(w3, s3, x=_bf16(768))]
    if case == "kmax":
        w3, s3 = _e4m3(16, 8192)
        return [P.Gemv(w3, s3, x=_bf16(8192))]
    if case == "row_bytes":  # 1,536-byte rows do not divide the slot
        w3, s3 = _e4m3(16, 1536)
        return [P.Gemv(w3, s3, x=_bf16(1536))]
    if case == "scales":
        return [P.Gemv(w, ws[:, :3], x=x)]
    if case == "no_x":
        return [P.Gemv(w, ws)]
    if case == "forward":
        return [P.Gemv(w, ws, src=1), good]
    if case == "slice":
        w5, s5 = _e4m3(8, 512)
        return [good, P.Gemv(w5, s5, src=0, src_off=0)]  # good has 64 rows < 512
    if case == "norm_fp32":
        w6, s6 = _e4m3(2048, 512)
        w7, s7 = _e4m3(8, 2048)
        return [P.Gemv(w6, s6, x=_bf16(512)), P.Gemv(w7, s7, src=0, norm_w=_bf16(2048))]
    if case == "dtype":
        return [P.Gemv(w.float(), x=x)]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["k", "kmax", "row_bytes", "scales", "no_x", "forward", "slice", "norm_fp32",
                                  "dtype"])
def test_check_refuses_what_the_kernel_cannot_run(case):
    with pytest.raises(ValueError):
        P.Program(_bad(case))


def test_tagged_words_decode_to_their_values():
    v32 = torch.randn(37)
    v16 = torch.randn(37).to(torch.bfloat16)
    tag = torch.full((37,), 5, dtype=torch.int64) << 32
    w32 = tag | v32.view(torch.int32).to(torch.int64).bitwise_and(0xFFFFFFFF)
    w16 = tag | v16.view(torch.int16).to(torch.int64).bitwise_and(0xFFFF)
    assert torch.equal(P.decode(w32, bf16=False), v32)
    assert torch.equal(P.decode(w16, bf16=True), v16)
    prog = P.Program(_chain()[:1])
    prog.y[0].copy_(w16.repeat(30)[:1100])
    assert torch.equal(prog.tags(0), torch.full((1100,), 5, dtype=torch.int32))


def test_reference_is_the_block_scaled_product_of_the_normed_x():
    g = _chain()[0]
    x = _bf16(2048, seed=9).float()
    got = P.reference(g, x)
    xn = ref.rms_norm(x.to(torch.bfloat16), g.norm_w, g.eps).double()
    want = torch.zeros(1100, dtype=torch.float64)
    for rb in range(9):
        for kb in range(16):
            blk = g.w[rb * 128 : (rb + 1) * 128, kb * 128 : (kb + 1) * 128].double()
            part = blk @ xn[kb * 128 : (kb + 1) * 128]
            want[rb * 128 : rb * 128 + blk.shape[0]] += float(g.ws[rb, kb]) * part
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-9)


def test_constants_are_mega_cu_s():
    src = CU.read_text()

    def const(name):
        return int(re.search(rf"constexpr int {name} = (\d+);", src).group(1))

    assert (const("NCW"), const("SLOT"), const("NSLOTS"), const("KMAX")) == (P.NCW, P.SLOT, P.NSLOTS, P.KMAX)
    assert "static_assert(sizeof(Instr) == 96" in src and P.WORDS * 8 == 96
