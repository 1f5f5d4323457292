"""Programs for the batch-1 megakernel (`mega.cu`, plan in docs/megakernel.md): instructions as
frozen dataclasses, checked against the kernel's rules and packed into the [n, WORDS] int64 table the
kernel reads (its `Instr` struct: op, 12 int32 fields, 2 floats, 12 pointers), with one tagged output
buffer per instruction allocated once.

Outputs are 64-bit words, the step's tag in the high half and the value bits in the low (fp32, or bf16
in the low 16 bits), so a consumer polls the data itself; `Program.values` decodes them. An `x` names
where an instruction's input vector comes from: an earlier instruction's outputs (`Src`), a vector
ready at launch (`Vec`) or the row of the step's token in an embedding table (`Embed`).

Instructions (each one's numerics are `emulate.py`'s, which follows the engine's decode kernels):
`Gemv` (y = W . prologue(x): e4m3 W8A16 with block scales or bf16; prologues RMSNorm, add + RMSNorm,
the DeltaNet gated norm; the DeltaNet conv epilogue), `GateUp` and `Down` (the routed + shared
experts of one token: routing from the router's logits, SiLU x up, the weighted sum in slot order plus
the residual), `DeltaState` (the gated delta rule on the recurrent state), `Attend` and `Combine`
(split-KV decode attention with q/k norm, RoPE and the cache write; the gated combine).

Step inputs live in one int64 device vector `step` [STEP_WORDS] that the runner fills before each
launch: token id, position, KV slot, state slot, has-state, sequence length (STEP_* indices).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch

# mega.cu's constants (MegaKernel checks them against the compiled kernel's `mega_constants`)
NCW = 8
THREADS = 32 * (NCW + 1)
SLOT = 32768
NSLOTS = 6
KMAX = 4608  # the widest x: 4,096 (out_proj, o_proj), or the 9 experts' 512 (the down projections)
SCRATCH = 3072  # floats of per-op scratch (reductions, attention scores and partial sums)
MAX_SCORES = 1024  # the most positions one attention split scores (Attend: splits >= seq_len / 1024)
MAX_EXPERTS = 256  # the router's experts (8 logits per lane of one warp)
ROUTE_WORDS = 32  # the producer's routing: up to 16 (id, weight) slots (Down's consumers read it)
N_INTS, N_PTRS = 12, 12
WORDS = 1 + N_INTS // 2 + 1 + N_PTRS  # 20 words, 160 bytes
SCALE_BYTES = 256  # per slot: the block scales of the slot's chunk (the producer copies them with it)
RING_ALIGN = 1024  # mega_base.cuh: the ring's alignment (slack in the shared memory)
SMEM = (RING_ALIGN + NSLOTS * SLOT + NSLOTS * SCALE_BYTES + 2 * NSLOTS * 8 + KMAX * 4 + SCRATCH * 4
        + ROUTE_WORDS * 4)

STATE_WORDS = 8  # the kernel's state: step tag, CTAs finished, watchdog code / CTA / instruction / detail
ERR_DATA, ERR_FULL, ERR_EMPTY = 1, 2, 3  # mega.cu's watchdog codes
STEP_TOKEN, STEP_POS, STEP_KV_SLOT, STEP_STATE_SLOT, STEP_HAS_STATE, STEP_SEQ_LEN = range(6)
STEP_WORDS = 8

OP_GEMV, OP_GATE_UP, OP_DOWN, OP_DELTA, OP_ATTEND, OP_COMBINE = 1, 2, 3, 4, 5, 6
W_E4M3, W_BF16 = 0, 1
PRO_NONE, PRO_RMSNORM, PRO_ADD_RMSNORM, PRO_GATED_NORM = 0, 1, 2, 3
OUT_F32, OUT_BF16, OUT_PLAIN_F32 = 0, 1, 2
EPI_NONE, EPI_CONV = 0, 1
X_SRC, X_VEC, X_EMBED = 0, 1, 2
CONV_K = 4  # the DeltaNet conv kernel (its state holds CONV_K - 1 inputs)


# ---- where x comes from ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Src:
    """An earlier instruction's outputs [off, off + n)."""

    index: int
    off: int = 0


@dataclass(frozen=True)
class Vec:
    """A bf16 vector ready at launch."""

    t: torch.Tensor


@dataclass(frozen=True)
class Embed:
    """Row step[STEP_TOKEN] of a bf16 embedding table [V, H]."""

    table: torch.Tensor


X = Src | Vec | Embed


# ---- instructions ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gemv:
    """y [rows] = w [rows, k] . prologue(x). Prologues: norm_w alone, RMSNorm x / rms(x) * (1 + w);
    with add, RMSNorm of bf16(x + add) (a residual add; both bf16); gated (DeltaNet): per head of
    head_dim values, the gated RMSNorm of x (the core output) with z = `add` (norm_w plain, [head_dim]).
    conv: the DeltaNet decode conv + SiLU on rows < conv_w.shape[0] (their conv state updated)."""

    w: torch.Tensor  # [rows, k] float8_e4m3fn or bfloat16
    x: X
    ws: torch.Tensor | None = None  # e4m3: [ceil(rows / 128), k / 128] fp32 block scales
    norm_w: torch.Tensor | None = None  # [k] bf16 (gated: [head_dim])
    add: Src | None = None
    gated: bool = False
    head_dim: int = 0
    eps: float = 1e-6
    out: int = OUT_BF16
    plain_out: torch.Tensor | None = None  # OUT_PLAIN_F32: [rows] fp32, written untagged
    conv_state: torch.Tensor | None = None  # EPI_CONV: [S, CONV_K - 1, C] bf16
    conv_w: torch.Tensor | None = None  # [C, CONV_K] bf16

    @property
    def rows(self) -> int:
        return self.w.shape[0]

    @property
    def k(self) -> int:
        return self.w.shape[1]


@dataclass(frozen=True)
class GateUp:
    """act [(top_k + 1) * I] bf16: for each slot j (the top_k routed experts of the router's logits,
    then the shared expert, id E), silu(gate_e x) * up_e x, x = the RMSNorm of bf16(h + add) (the
    router's own prologue). w [E + 1, 2I, H] e4m3, ws [E + 1, 2I / 128, H / 128]."""

    w: torch.Tensor
    ws: torch.Tensor
    x: X  # the residual stream h (bf16)
    add: Src
    norm_w: torch.Tensor
    logits: Src  # the router's outputs: [E + 1] bf16 (the shared expert's gate last), off 0
    top_k: int
    eps: float = 1e-6

    @property
    def rows(self) -> int:  # outputs
        return (self.top_k + 1) * self.w.shape[1] // 2


@dataclass(frozen=True)
class Down:
    """h' [H] bf16 = bf16(bf16(sum_j w_j down_e(act_j)) + r), the slots in order, w_j the routing
    weights (renormalised top-k, then sigmoid of the shared gate), r = bf16(res + res_add) the
    residual stream. w [E + 1, H, I] e4m3, ws [E + 1, H / 128, I / 128]."""

    w: torch.Tensor
    ws: torch.Tensor
    act: Src  # GateUp's outputs
    logits: Src
    res: X  # the residual stream h (bf16)
    res_add: Src
    top_k: int

    @property
    def rows(self) -> int:
        return self.w.shape[1]


@dataclass(frozen=True)
class DeltaState:
    """The gated delta rule on the state slot step[STEP_STATE_SLOT] (zeros where not has-state) from
    the conv'd in_proj outputs: q, k [Hk, Dk] at qkv offsets 0, Hk * Dk; v [Hv, Dv] after them; b, a
    [Hv] at b_off, a_off. Outputs: core [Hv * Dv] bf16. state [S, Hv, Dk, Dv] fp32, in place."""

    proj: Src  # the in_proj instruction (off = 0)
    state: torch.Tensor
    A_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]
    hk: int
    b_off: int
    a_off: int

    @property
    def rows(self) -> int:
        return self.state.shape[1] * self.state.shape[3]


@dataclass(frozen=True)
class Attend:
    """Split-KV decode attention of one token: q rows [Hq, 2D] (query, gate) and k, v [Hkv, D] from the
    qkv instruction; q/k RMSNorm (1 + w) and NeoX RoPE on the first rotary_dim dims at step[STEP_POS];
    this step's key and value stored at KV slot step[STEP_KV_SLOT]; scores over step[STEP_SEQ_LEN]
    positions of the block table. Outputs per (head, split): D fp32 partial outputs, then m and
    log2-sum (log2 units) -> [Hq * splits * (D + 2)]."""

    qkv: Src
    k_cache: torch.Tensor  # [N, block, Hkv, D] bf16
    v_cache: torch.Tensor
    q_norm_w: torch.Tensor
    k_norm_w: torch.Tensor
    inv_freq: torch.Tensor  # [rotary_dim / 2] fp32
    block_table: torch.Tensor  # [max_blocks] int32
    hq: int
    splits: int
    eps: float = 1e-6

    @property
    def hkv(self) -> int:
        return self.k_cache.shape[2]

    @property
    def d(self) -> int:
        return self.k_cache.shape[3]

    @property
    def rows(self) -> int:
        return self.hq * self.splits * (self.d + 2)


@dataclass(frozen=True)
class Combine:
    """o [Hq * D] bf16: the splits' partials merged, times sigmoid(gate) (gate: the qkv rows' second
    half of each head), each rounded to bf16 first as the engine's gated output."""

    parts: Src  # the Attend instruction
    qkv: Src
    hq: int
    d: int
    splits: int

    @property
    def rows(self) -> int:
        return self.hq * self.d


Instr = Gemv | GateUp | Down | DeltaState | Attend | Combine


# ---- checks ---------------------------------------------------------------------------------------
def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {what}")


def _src(p: list[Instr], i: int, s: Src, n: int, where: str, bf16: bool | None = None) -> None:
    _need(0 <= s.index < i, where, f"source {s.index} must be an earlier instruction")
    _need(s.off >= 0 and s.off + n <= p[s.index].rows, where,
          f"reads outputs [{s.off}, {s.off + n}) of instruction {s.index}, which has {p[s.index].rows}")
    if bf16 is not None:
        _need(out_dtype(p[s.index]) == (OUT_BF16 if bf16 else OUT_F32), where,
              f"instruction {s.index} must store {'bf16' if bf16 else 'fp32'}")


def _staged(p: list[Instr], i: int, s: Src, n: int, where: str, bf16: bool | None = True) -> None:
    """A source that an x prologue reads in pairs of words (16-byte loads): from an even offset."""
    _src(p, i, s, n, where, bf16)
    _need(s.off % 2 == 0, where, f"a staged source reads pairs of words: offset {s.off} must be even")


def _x(p: list[Instr], i: int, x: X, n: int, where: str, bf16: bool | None = True) -> None:
    """x of a prologue, staged in pairs (so vectors 4-byte aligned), or Down's residual."""
    if isinstance(x, Src):
        _staged(p, i, x, n, where, bf16)
    elif isinstance(x, Vec):
        _need(x.t.dtype == torch.bfloat16 and tuple(x.t.shape) == (n,) and x.t.is_contiguous()
              and x.t.data_ptr() % 4 == 0, where, f"x: contiguous bf16 [{n}], 4-byte aligned")
    elif isinstance(x, Embed):
        _need(x.table.dtype == torch.bfloat16 and x.table.dim() == 2 and x.table.shape[1] == n
              and x.table.is_contiguous() and x.table.data_ptr() % 4 == 0, where,
              f"embedding table: contiguous bf16 [V, {n}], 4-byte aligned")
    else:
        raise ValueError(f"{where}: x must be Src, Vec or Embed")


def out_dtype(g: Instr) -> int:
    """The value kind of an instruction's outputs."""
    if isinstance(g, Gemv):
        return g.out
    return OUT_F32 if isinstance(g, Attend) else OUT_BF16


def _e4m3(w: torch.Tensor, ws: torch.Tensor | None, where: str) -> None:
    _need(w.dtype == torch.float8_e4m3fn and w.is_contiguous(), where, "w must be contiguous e4m3")
    want = (*w.shape[:-2], (w.shape[-2] + 127) // 128, (w.shape[-1] + 127) // 128)
    _need(ws is not None and tuple(ws.shape) == want and ws.dtype == torch.float32 and ws.is_contiguous(),
          where, f"e4m3 weights need contiguous fp32 block scales of shape {want}")
    _need(ws.data_ptr() % 16 == 0, where, "block scales must start 16-byte aligned (bulk copies)")


def _norm_w(w: torch.Tensor, n: int, where: str) -> None:
    _need(w.dtype == torch.bfloat16 and tuple(w.shape) == (n,) and w.is_contiguous()
          and w.data_ptr() % 16 == 0, where, f"norm_w bf16 [{n}], contiguous, 16-byte aligned")


def check(p: list[Instr]) -> None:
    """Raises ValueError where an instruction breaks one of mega.cu's rules."""
    _need(len(p) > 0, "program", "empty")
    for i, g in enumerate(p):
        where = f"instruction {i} ({type(g).__name__})"
        if isinstance(g, Gemv):
            e4m3 = g.w.dtype == torch.float8_e4m3fn
            _need(g.w.dim() == 2 and (e4m3 or g.w.dtype == torch.bfloat16) and g.w.is_contiguous(),
                  where, "w must be a contiguous [rows, k] e4m3 or bf16 matrix")
            _need(g.k % 512 == 0 and 512 <= g.k <= 4096,
                  where, f"k = {g.k}: a multiple of 512 in [512, 4096]")
            _need(SLOT % (g.k * g.w.element_size()) == 0, where, "a row must divide the slot")
            if g.w.dtype == torch.float8_e4m3fn:
                _e4m3(g.w, g.ws, where)
            else:
                _need(g.ws is None, where, "bf16 weights take no block scales")
            _x(p, i, g.x, g.k, where, bf16=True if g.norm_w is not None else None)
            if g.gated:
                _need(isinstance(g.x, Src) and g.add is not None and g.head_dim > 0 and g.k % g.head_dim == 0,
                      where, "the gated norm takes x and z from instructions, whole heads")
                _need(g.norm_w is not None and tuple(g.norm_w.shape) == (g.head_dim,),
                      where, "norm_w [head_dim]")
                _need(g.head_dim in (64, 128) and (g.k // NCW) % g.head_dim == 0, where,
                      "gated: head_dim 64 or 128, dividing k / 8 (whole heads per warp)")
            elif g.norm_w is not None:
                _norm_w(g.norm_w, g.k, where)
            if g.add is not None:
                _need(g.gated or g.norm_w is not None, where, "add goes with a norm prologue")
                _staged(p, i, g.add, g.k, where)
            if g.out == OUT_PLAIN_F32:
                _need(g.plain_out is not None and g.plain_out.dtype == torch.float32
                      and tuple(g.plain_out.shape) == (g.rows,), where, "plain_out: fp32 [rows]")
            if g.conv_w is not None:
                C = g.conv_w.shape[0]
                _need(g.out == OUT_BF16 and C <= g.rows and g.conv_w.shape[1] == CONV_K,
                      where, "conv_w [C, 4]")
                _need(g.conv_state is not None and g.conv_state.shape[1:] == (CONV_K - 1, C)
                      and g.conv_state.is_contiguous(), where, "conv_state: [S, 3, C] contiguous")
        elif isinstance(g, GateUp):
            _e4m3(g.w, g.ws, where)
            E1, I2, H = g.w.shape
            _need(H % 512 == 0 and H <= 4096 and I2 % 32 == 0 and (I2 // 2) % 8 == 0, where, "shapes")
            _x(p, i, g.x, H, where)
            _staged(p, i, g.add, H, where)
            _src(p, i, g.logits, E1, where, bf16=True)
            _need(g.logits.off == 0, where, "logits: the router's outputs from 0")
            _need(1 <= g.top_k < E1 and E1 - 1 <= MAX_EXPERTS and g.top_k + 1 <= 16, where, "top_k, experts")
            _need(16 * H <= SLOT, where, "8 gate + 8 up rows must fill at most a slot")
            _norm_w(g.norm_w, H, where)
        elif isinstance(g, Down):
            _e4m3(g.w, g.ws, where)
            E1, H, I = g.w.shape
            _need(I % 512 == 0 and SLOT % (16 * I) == 0, where, "I: a multiple of 512 (16 rows per piece)")
            gu = p[g.act.index]
            _need(isinstance(gu, GateUp) and gu.logits == g.logits and gu.top_k == g.top_k, where,
                  "act comes from the GateUp of the same routing")
            _staged(p, i, g.act, (g.top_k + 1) * I, where)
            _need((g.top_k + 1) * I <= KMAX, where, "the slots' activations must fit x")
            _src(p, i, g.logits, E1, where, bf16=True)
            _need(g.logits.off == 0, where, "logits: the router's outputs from 0")
            _x(p, i, g.res, H, where)
            _src(p, i, g.res_add, H, where, bf16=True)
        elif isinstance(g, DeltaState):
            S, Hv, Dk, Dv = g.state.shape
            _need(g.state.dtype == torch.float32 and g.state.is_contiguous(), where, "state: fp32 contiguous")
            _need(Dk == 128 and Dv % 32 == 0 and Hv % g.hk == 0, where, "Dk = 128, whole 32-column blocks")
            _src(p, i, g.proj, max(g.a_off, g.b_off) + Hv, where, bf16=True)
            src = p[g.proj.index]
            _need(g.proj.off == 0 and isinstance(src, Gemv) and src.conv_w is not None,
                  where, "proj is the conv'd in_proj")
        elif isinstance(g, Attend):
            _need(g.k_cache.shape == g.v_cache.shape and g.k_cache.dtype == torch.bfloat16, where, "caches")
            _need(g.d == 256 and g.hq % g.hkv == 0 and 1 <= g.splits, where, "head_dim 256, GQA")
            bs = g.k_cache.shape[1]
            _need(bs & (bs - 1) == 0, where, "the KV block size must be a power of two (the kernel shifts)")
            max_len = g.block_table.numel() * g.k_cache.shape[1]
            _need(-(-max_len // g.splits) <= MAX_SCORES, where,
                  f"a split may score {MAX_SCORES} positions: splits >= {-(-max_len // MAX_SCORES)}")
            _need(g.inv_freq.numel() * 2 <= g.d, where, "rotary dims")
            _need(g.block_table.dtype == torch.int32 and g.inv_freq.dtype == torch.float32, where, "dtypes")
            _src(p, i, g.qkv, 2 * g.hq * g.d + 2 * g.hkv * g.d, where, bf16=True)
        elif isinstance(g, Combine):
            _need(isinstance(p[g.parts.index], Attend), where, "parts come from an Attend")
            _src(p, i, g.parts, g.hq * g.splits * (g.d + 2), where, bf16=False)
            _src(p, i, g.qkv, 2 * g.hq * g.d, where, bf16=True)
        else:
            raise ValueError(f"{where}: not an instruction")


# ---- packing --------------------------------------------------------------------------------------
def _word(lo: int, hi: int) -> int:
    v = (lo & 0xFFFFFFFF) | ((hi & 0xFFFFFFFF) << 32)
    return v - (1 << 64) if v >= 1 << 63 else v


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


@dataclass
class _Fields:
    op: int
    out: int = OUT_BF16  # the kind of the instruction's output words (word 0's high half)
    ints: list[int] = field(default_factory=lambda: [0] * N_INTS)
    floats: tuple[float, float] = (0.0, 0.0)
    ptrs: list[int] = field(default_factory=lambda: [0] * N_PTRS)


def _x_fields(f: _Fields, x: X, base: int) -> None:
    """x's kind and source into ints[base:base + 3], its pointer (Vec, Embed) into ptrs[3]."""
    if isinstance(x, Src):
        f.ints[base : base + 3] = [X_SRC, x.index, x.off]
    elif isinstance(x, Vec):
        f.ints[base] = X_VEC
        f.ptrs[3] = x.t.data_ptr()
    else:
        f.ints[base] = X_EMBED
        f.ptrs[3] = x.table.data_ptr()


def units(g: Instr) -> tuple[int, int]:
    """g's work units (dealt to the CTAs round robin: GEMV and GateUp chunks, Down's 16-row blocks,
    DeltaState's (head, 32 columns), Attend's (head, split), Combine's heads) and its chunking word: a GEMV's
    rows per chunk, Down's pieces per chunk | chunks per row block << 16 (0 otherwise)."""
    if isinstance(g, Gemv):
        rpc = SLOT // (g.k * g.w.element_size())
        return -(-g.rows // rpc), rpc
    if isinstance(g, GateUp):
        return (g.top_k + 1) * (g.w.shape[1] // 2 // 8), 0
    if isinstance(g, Down):
        E1, H, I = g.w.shape
        per = SLOT // (16 * I)
        return H // 16, per | (-(-(g.top_k + 1) // per) << 16)
    if isinstance(g, DeltaState):
        return g.state.shape[1] * (g.state.shape[3] // 32), 0
    if isinstance(g, Attend):
        return g.hq * g.splits, 0
    return g.hq, 0


def fields(g: Instr, y: torch.Tensor, step: torch.Tensor, base: int = 0) -> _Fields:
    """The kernel's view of g: mega.cu documents each op's use of ints[], floats[] and ptrs[]; base: the
    units of the instructions before g (ptrs[10]: units | base << 32; ptrs[11]: the chunking word)."""
    f = _op_fields(g, y, step)
    f.out = out_dtype(g)
    n, chunking = units(g)
    f.ptrs[10:12] = [n | (base << 32), chunking]
    return f


def _op_fields(g: Instr, y: torch.Tensor, step: torch.Tensor) -> _Fields:
    if isinstance(g, Gemv):
        f = _Fields(OP_GEMV)
        pro = PRO_GATED_NORM if g.gated else (PRO_ADD_RMSNORM if g.add else
                                              (PRO_RMSNORM if g.norm_w is not None else PRO_NONE))
        f.ints[:3] = [W_E4M3 if g.w.dtype == torch.float8_e4m3fn else W_BF16, g.rows, g.k]
        f.ints[3:5] = [pro, g.out]
        _x_fields(f, g.x, 5)  # ints 5, 6, 7
        f.ints[8:10] = [g.add.index, g.add.off] if g.add else [0, 0]
        f.ints[10] = EPI_CONV if g.conv_w is not None else EPI_NONE
        f.ints[11] = g.head_dim if g.gated else (g.conv_w.shape[0] if g.conv_w is not None else 0)
        f.floats = (g.eps, 0.0)
        f.ptrs[:3] = [_ptr(g.w), _ptr(g.ws), _ptr(g.norm_w)]
        f.ptrs[4:9] = [y.data_ptr(), _ptr(g.plain_out), _ptr(g.conv_state), _ptr(g.conv_w), step.data_ptr()]
        return f
    if isinstance(g, GateUp):
        f = _Fields(OP_GATE_UP)
        E1, I2, H = g.w.shape
        f.ints[:5] = [E1 - 1, I2 // 2, H, g.top_k, g.logits.index]
        _x_fields(f, g.x, 5)
        f.ints[8:10] = [g.add.index, g.add.off]
        f.floats = (g.eps, 0.0)
        f.ptrs[:3] = [g.w.data_ptr(), g.ws.data_ptr(), g.norm_w.data_ptr()]
        f.ptrs[4] = y.data_ptr()
        f.ptrs[8] = step.data_ptr()
        return f
    if isinstance(g, Down):
        f = _Fields(OP_DOWN)
        E1, H, I = g.w.shape
        f.ints[:5] = [E1 - 1, I, H, g.top_k, g.logits.index]
        _x_fields(f, g.res, 5)
        f.ints[8:12] = [g.act.index, g.act.off, g.res_add.index, g.res_add.off]
        f.ptrs[:2] = [g.w.data_ptr(), g.ws.data_ptr()]
        f.ptrs[4] = y.data_ptr()
        f.ptrs[8] = step.data_ptr()
        return f
    if isinstance(g, DeltaState):
        f = _Fields(OP_DELTA)
        S, Hv, Dk, Dv = g.state.shape
        f.ints[:6] = [g.hk, Hv, Dk, Dv, g.b_off, g.a_off]
        f.ints[6] = g.proj.index
        f.ptrs[:3] = [g.state.data_ptr(), g.A_log.data_ptr(), g.dt_bias.data_ptr()]
        f.ptrs[4] = y.data_ptr()
        f.ptrs[8] = step.data_ptr()
        return f
    if isinstance(g, Attend):
        f = _Fields(OP_ATTEND)
        f.ints[:8] = [g.hq, g.hkv, g.d, 2 * g.inv_freq.numel(), g.splits, g.k_cache.shape[1], g.qkv.index,
                      g.qkv.off]
        f.floats = (g.eps, g.d**-0.5)
        f.ptrs[:4] = [_ptr(g.k_cache), _ptr(g.v_cache), _ptr(g.q_norm_w), _ptr(g.k_norm_w)]
        f.ptrs[4:9] = [y.data_ptr(), g.inv_freq.data_ptr(), g.block_table.data_ptr(), 0, step.data_ptr()]
        return f
    f = _Fields(OP_COMBINE)
    f.ints[:7] = [g.hq, g.d, g.splits, g.parts.index, g.parts.off, g.qkv.index, g.qkv.off]
    f.ptrs[4] = y.data_ptr()
    return f


def pack(f: _Fields) -> list[int]:
    ints = [_word(f.ints[2 * j], f.ints[2 * j + 1]) for j in range(N_INTS // 2)]
    return [_word(f.op, f.out), *ints, _word(_f32_bits(f.floats[0]), _f32_bits(f.floats[1])), *f.ptrs]


class Program:
    """A checked program on its device: the packed table [n, WORDS] int64, one tagged output buffer per
    instruction (`y[i]` [rows] int64, zeros: tag 0 is never a step's), the step inputs `step`, and the
    kernel's counters `state` (step tag, finished CTAs)."""

    def __init__(self, instrs: list[Instr], step: torch.Tensor | None = None, arena: bool = True) -> None:
        check(instrs)
        self.instrs = list(instrs)
        dev = _device(instrs[0])
        if step is None:
            step = torch.zeros(STEP_WORDS, dtype=torch.int64, device=dev)
        self.step_inputs = step
        _need(self.step_inputs.dtype == torch.int64 and self.step_inputs.numel() >= STEP_WORDS, "program",
              "step: int64 [STEP_WORDS]")
        # one arena for every output (each start 16-byte aligned): a handful of pages, not 250 scattered
        # allocations among the weights (measured 2026-12-02: the same step time either way)
        offs, total = [], 0
        for g in instrs:
            offs.append(total)
            total += -(-g.rows // 2) * 2
        if arena:
            self.arena = torch.zeros(max(total, 2), dtype=torch.int64, device=dev)
            self.y = [self.arena[o:o + g.rows] for o, g in zip(offs, instrs)]
        else:  # (one allocation per output: the layout before the arena, kept to measure it)
            self.y = [torch.zeros(g.rows, dtype=torch.int64, device=dev) for g in instrs]
        rows, base = [], 0
        for g, y in zip(instrs, self.y):
            rows.append(pack(fields(g, y, self.step_inputs, base)))
            base += units(g)[0]
        self.table = torch.tensor(rows, dtype=torch.int64).to(dev)  # [n, WORDS]
        self.tensor_maps: torch.Tensor | None = None  # launch.MegaKernel.prepare: the wgmma GEMVs' TMA maps
        # the kernel's words: the last step's tag, the CTAs finished, the watchdog (code, CTA, instruction,
        # detail: mega.cu's give_up)
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=dev)

    @property
    def bytes(self) -> int:
        """Weight bytes one launch streams at least (dense weights, and the experts' routed slots)."""
        total = 0
        for g in self.instrs:
            if isinstance(g, Gemv):
                total += g.w.numel() * g.w.element_size()
            elif isinstance(g, (GateUp, Down)):
                total += (g.top_k + 1) * g.w[0].numel()
        return total

    def step(self) -> int:
        """The tag of the last completed launch (0 before any)."""
        return int(self.state[0])

    def error(self) -> str | None:
        """What the kernel's watchdog recorded (a wait that timed out, then every wait aborted), or None.
        Reads the device (a sync)."""
        code, cta, instr, detail = self.state[2:6].tolist()
        if code == 0:
            return None
        what = {ERR_DATA: "polled an input that never came (element",
                ERR_FULL: "waited for a weight chunk (slot",
                ERR_EMPTY: "the producer waited for a free slot (slot"}.get(code, f"code {code} (detail")
        name = type(self.instrs[instr]).__name__ if 0 <= instr < len(self.instrs) else "?"
        return f"CTA {cta} at instruction {instr} ({name}) {what} {detail})"

    def reset_error(self) -> None:
        self.state[2:].zero_()

    def values(self, i: int) -> torch.Tensor:
        """Instruction i's outputs: bf16 or fp32 [rows]."""
        return decode(self.y[i], out_dtype(self.instrs[i]) == OUT_BF16)

    def tags(self, i: int) -> torch.Tensor:
        """The tag half of instruction i's output words [rows] int32."""
        return self.y[i].view(torch.int32).view(-1, 2)[:, 1]


def _device(g: Instr) -> torch.device:
    for name in ("w", "state", "k_cache"):
        if hasattr(g, name):
            return getattr(g, name).device
    raise ValueError("the first instruction must own a weight, state or cache tensor")


def decode(words: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Tagged words [n] int64 -> their values: fp32 (low half), or bf16 (low 16 bits)."""
    halves = words.view(torch.int32).view(-1, 2)[:, 0].contiguous()
    if bf16:
        return halves.view(torch.int16).view(-1, 2)[:, 0].contiguous().view(torch.bfloat16)
    return halves.view(torch.float32)


def encode(values: torch.Tensor, tag: int) -> torch.Tensor:
    """decode's inverse: bf16 or fp32 values [n] -> words [n] int64 under `tag`."""
    if values.dtype == torch.bfloat16:
        bits = values.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    else:
        bits = values.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return bits | (tag << 32)
