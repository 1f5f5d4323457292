"""Programs for the batch-1 megakernel (`mega.cu`, plan in benchmarks/MEGAKERNEL.md): instructions as
frozen dataclasses, checked against the kernel's rules and packed into the [n, 12] int64 table the
kernel reads (its `Instr` struct, word by word), with the output buffers allocated once.

v0 has one instruction, `Gemv`: y = W . prologue(x), W [rows, k] e4m3 with 128 x 128 block scales
(W8A16) or bf16, x the launch input or an earlier instruction's outputs, prologue none or RMSNorm,
outputs fp32 or bf16. Outputs are tagged 64-bit words (the step's tag in the high half); `values`
decodes them. `reference` computes an instruction in float64 from given x (the kernel's test oracle).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from metainfer.kernels import reference as ref

# mega.cu's constants (MegaKernel checks them against the compiled kernel's `mega_constants`)
NCW = 8
THREADS = 32 * (NCW + 1)
SLOT = 32768
NSLOTS = 6
KMAX = 4096
WORDS = 12
SMEM = NSLOTS * SLOT + 2 * NSLOTS * 8 + KMAX * 4 + NCW * 4

OP_GEMV = 1
W_E4M3, W_BF16 = 0, 1
PRO_NONE, PRO_RMSNORM = 0, 1
OUT_F32, OUT_BF16 = 0, 1


@dataclass(frozen=True)
class Gemv:
    """y [rows] = w [rows, k] . prologue(x). x: the launch input `x` [k] bf16 (src = -1) or instruction
    src's outputs [src_off, src_off + k). norm_w [k] bf16: the RMSNorm prologue (reference.rms_norm)."""

    w: torch.Tensor  # [rows, k] float8_e4m3fn or bfloat16
    ws: torch.Tensor | None = None  # e4m3: [ceil(rows / 128), k / 128] fp32 block scales
    src: int = -1
    src_off: int = 0
    x: torch.Tensor | None = None  # [k] bf16, src == -1
    norm_w: torch.Tensor | None = None  # [k] bf16
    eps: float = 1e-6
    out_bf16: bool = False

    @property
    def rows(self) -> int:
        return self.w.shape[0]

    @property
    def k(self) -> int:
        return self.w.shape[1]

    @property
    def e4m3(self) -> bool:
        return self.w.dtype == torch.float8_e4m3fn


def check(program: list[Gemv]) -> None:
    """Raises ValueError where an instruction breaks one of mega.cu's rules."""
    if not program:
        raise ValueError("empty program")
    for i, g in enumerate(program):
        where = f"instruction {i}"
        if g.w.dim() != 2 or not g.w.is_contiguous():
            raise ValueError(f"{where}: w must be a contiguous [rows, k] matrix")
        if g.w.dtype not in (torch.float8_e4m3fn, torch.bfloat16):
            raise ValueError(f"{where}: w must be float8_e4m3fn or bfloat16, got {g.w.dtype}")
        if g.k % 512 or not 512 <= g.k <= KMAX:
            raise ValueError(f"{where}: k = {g.k} must be a multiple of 512 in [512, {KMAX}]")
        row_bytes = g.k * g.w.element_size()
        if SLOT % row_bytes:
            raise ValueError(f"{where}: a row of {row_bytes} bytes must divide the {SLOT}-byte slot")
        if g.e4m3:
            want = ((g.rows + 127) // 128, g.k // 128)
            ws = g.ws
            if ws is None or tuple(ws.shape) != want or ws.dtype != torch.float32 or not ws.is_contiguous():
                raise ValueError(f"{where}: e4m3 weights need contiguous fp32 block scales of shape {want}")
        elif g.ws is not None:
            raise ValueError(f"{where}: bf16 weights take no block scales")
        if g.src < 0:
            x = g.x
            if x is None or x.dtype != torch.bfloat16 or tuple(x.shape) != (g.k,) or not x.is_contiguous():
                raise ValueError(f"{where}: src = -1 needs a contiguous bf16 x of shape ({g.k},)")
        else:
            if g.src >= i:
                raise ValueError(f"{where}: src {g.src} must be an earlier instruction")
            if g.src_off < 0 or g.src_off + g.k > program[g.src].rows:
                raise ValueError(f"{where}: x = outputs [{g.src_off}, {g.src_off + g.k}) of instruction "
                                 f"{g.src}, which has {program[g.src].rows}")
        if g.norm_w is not None:
            if g.norm_w.dtype != torch.bfloat16 or tuple(g.norm_w.shape) != (g.k,):
                raise ValueError(f"{where}: norm_w must be bf16 of shape ({g.k},)")
            if g.src >= 0 and not program[g.src].out_bf16:
                raise ValueError(f"{where}: the RMSNorm prologue takes bf16 x (a residual stream); "
                                 f"instruction {g.src} stores fp32")
        tensors = [t for t in (g.w, g.ws, g.x, g.norm_w) if t is not None]
        if any(t.device != g.w.device for t in tensors):
            raise ValueError(f"{where}: every tensor must be on one device")


def _word(lo: int, hi: int) -> int:
    v = (lo & 0xFFFFFFFF) | ((hi & 0xFFFFFFFF) << 32)
    return v - (1 << 64) if v >= 1 << 63 else v


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


class Program:
    """A checked program on its device: the packed table `table` [n, WORDS] int64 and one tagged output
    buffer per instruction (`y[i]` [rows] int64, zeros: tag 0 is never a step's)."""

    def __init__(self, instrs: list[Gemv]) -> None:
        check(instrs)
        self.instrs = list(instrs)
        dev = instrs[0].w.device
        self.y = [torch.zeros(g.rows, dtype=torch.int64, device=dev) for g in instrs]
        rows = []
        for g, y in zip(instrs, self.y):
            ptr = [t.data_ptr() if t is not None else 0 for t in (g.w, g.ws, g.norm_w, g.x)]
            rows.append([
                _word(OP_GEMV, W_E4M3 if g.e4m3 else W_BF16),
                _word(g.rows, g.k),
                _word(PRO_RMSNORM if g.norm_w is not None else PRO_NONE, OUT_BF16 if g.out_bf16 else OUT_F32),
                _word(g.src, _f32_bits(g.eps)),
                *ptr,
                y.data_ptr(),
                g.src_off,
                0,
                0,
            ])
        self.table = torch.tensor(rows, dtype=torch.int64).to(dev)  # [n, WORDS]
        # the step counter (the kernel's step_tag) and the finished-CTA counter
        self.state = torch.zeros(2, dtype=torch.int32, device=dev)

    @property
    def bytes(self) -> int:
        """Weight bytes one launch streams (the byte floor's numerator)."""
        return sum(g.w.numel() * g.w.element_size() for g in self.instrs)

    def step(self) -> int:
        """The tag of the last completed launch (0 before any)."""
        return int(self.state[0])

    def values(self, i: int) -> torch.Tensor:
        """Instruction i's outputs: fp32 [rows], or bf16 [rows] where out_bf16."""
        return decode(self.y[i], self.instrs[i].out_bf16)

    def tags(self, i: int) -> torch.Tensor:
        """The tag half of instruction i's output words [rows] int32."""
        return self.y[i].view(torch.int32).view(-1, 2)[:, 1]

    def x_of(self, i: int) -> torch.Tensor:
        """The x instruction i reads (before its prologue), as the kernel sees it: [k] fp32 values."""
        g = self.instrs[i]
        if g.src < 0:
            return g.x.float()
        return self.values(g.src)[g.src_off : g.src_off + g.k].float()


def decode(words: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Tagged words [n] int64 -> their values: fp32 (low half), or bf16 (low 16 bits)."""
    halves = words.view(torch.int32).view(-1, 2)[:, 0].contiguous()
    if bf16:
        return halves.view(torch.int16).view(-1, 2)[:, 0].contiguous().view(torch.bfloat16)
    return halves.view(torch.float32)


def dequant(g: Gemv) -> torch.Tensor:
    """g's weights in float64 [rows, k] (e4m3 times each 128 x 128 block's scale)."""
    w = g.w.to(torch.float64)
    if g.e4m3:
        s = g.ws.to(torch.float64).repeat_interleave(128, 0)[: g.rows].repeat_interleave(128, 1)
        w = w * s
    return w


def reference(g: Gemv, x: torch.Tensor) -> torch.Tensor:
    """g's outputs in float64 [rows] from x [k] (the values it reads, before the prologue). The
    prologue is reference.rms_norm on x in bf16, as the engine's norms see the residual stream."""
    if g.norm_w is not None:
        x = ref.rms_norm(x.to(torch.bfloat16), g.norm_w, g.eps)
    return dequant(g) @ x.to(torch.float64)
