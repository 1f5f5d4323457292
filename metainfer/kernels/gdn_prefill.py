"""Chunked (WY) gated delta rule for prefill: one sequence, or many sequences in one launch pair.

Semantics of `reference.gated_delta_rule_chunked` (chunk C = 64): per chunk of a sequence, with
cumulative log decay c, A[i, j] = beta_i e^(c_i - c_j) k_i.k_j (j < i), T = (I + A)^-1,
W = T diag(beta e^c) K, U0 = T diag(beta) V; then, chunk after chunk, U = U0 - W S,
O = (Q e^c) S + (Q K^T o D) U and S' = e^(c_last) S + (K e^(c_last - c))^T U.

Two kernels:
  - `_prep_kernel`, grid (max chunks per sequence, N, Hv), fully parallel, one chunk of one value
    head per program: l2-normalised q, k, the cumsum c of g, T (the B x B diagonal blocks of I + A
    by forward substitution, all blocks at once, then log2(C / B) block-doubling products), and
    W, U0, K e^(c_last - c), Q e^c and the causal decayed Q K^T, stored at the chunk's token rows
    of workspaces (rows past a sequence's end are masked: the reference's zero padding);
  - `_scan_kernel`, grid (N, Hv, Dv / BLOCK_V): the state recurrence over the chunks of one sequence
    for one value-column block, the fp32 state [Dk, BLOCK_V] in registers, the output in the same
    pass. Its loop only loads and multiplies.
Precision: fp32 arithmetic and accumulation. Dots that feed the state (K K^T, the inverse, W, U0,
W S, K^T U) use `state_prec`: "bf16x3" splits each fp32 operand x into bf16 hi + lo (x - hi - lo
~ 2^-17 x) and sums hi.hi + hi.lo + lo.hi on bf16 tensor cores (W and K e^(c_last - c) are stored
as hi/lo planes); "tf32x3" / "tf32" / "ieee" are tl.dot's fp32 modes. Dots that feed only the
output (Q S, (Q K^T) U) use `out_prec`: "bf16" (default for 16-bit inputs) stores Q e^c and Q K^T
in bf16 and rounds S, U to bf16 for them; else fp32 in that mode. Exponents are non-positive
differences of c only (g <= 0), masked before exp. Varlen sequences come as a device cu_seqlens;
the host gives only max_seqlen (the prep grid): no host synchronisation, CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from metainfer.kernels import gdn_decode, pdl
from metainfer.kernels.common import interpreting

_TL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK = 64


@dataclass
class PrefillConfig:
    block_v: int = 32  # value columns per scan program
    # diagonal blocks of I + A solved by substitution (B - 1 steps), then log2(64 / B) doubling products;
    # 64 / B a power of 2 (B = 2 with 4 warps: benchmarks/gdn_prefill.py --grid's pick on the H200)
    sub_block: int = 2
    prep_warps: int = 4
    scan_warps: int = 4
    scan_stages: int = 2
    state_prec: str = "bf16x3"  # "bf16x3" | "tf32x3" | "tf32" | "ieee"
    out_prec: str | None = None  # "bf16" | "tf32" | "tf32x3" | "ieee"; None: bf16 (16-bit v) or tf32x3


CONFIG = PrefillConfig()


@triton.jit
def _seq_bounds(cu_ptr, n, T, VARLEN: tl.constexpr):
    """Rows [bos, eos) of sequence n: from the cumulative lengths when VARLEN, else all T rows."""
    if VARLEN:
        return tl.load(cu_ptr + n), tl.load(cu_ptr + n + 1)
    return 0, T


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    # bf16 a @ b + acc (fp32); UPCAST only under TRITON_INTERPRET, whose bf16 dot is broken
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _to(x, DT: tl.constexpr, UPCAST: tl.constexpr):
    # fp32 x -> DT, rounding to nearest even (which the interpreter's own bf16 cast does not)
    if UPCAST and DT == tl.bfloat16:
        i = x.to(tl.uint32, bitcast=True)
        x = (((i + 0x7FFF + ((i >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(DT)


@triton.jit
def _split(x, UPCAST: tl.constexpr):
    # fp32 x -> (hi, lo) bf16 with x = hi + lo + O(2^-17 |x|)
    hi = _to(x, tl.bfloat16, UPCAST)
    return hi, _to(x - hi.to(tl.float32), tl.bfloat16, UPCAST)


@triton.jit
def _dot3(ah, al, b, UPCAST: tl.constexpr):
    # (ah + al) @ b for bf16 planes ah, al and fp32 b, to ~2^-16 relative, fp32 accumulation
    bh, bl = _split(b, UPCAST)
    acc = _mma(al, bh, tl.zeros((ah.shape[0], b.shape[1]), dtype=tl.float32), UPCAST)
    return _mma(ah, bh, _mma(ah, bl, acc, UPCAST), UPCAST)


@triton.jit
def _xdot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # fp32 a @ b at PREC: "bf16x3" | "bf16" | a tl.dot input precision
    if PREC == "bf16x3":
        ah, al = _split(a, UPCAST)
        return _dot3(ah, al, b, UPCAST)
    elif PREC == "bf16":
        zero = tl.zeros((a.shape[0], b.shape[1]), dtype=tl.float32)
        return _mma(_to(a, tl.bfloat16, UPCAST), _to(b, tl.bfloat16, UPCAST), zero, UPCAST)
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _store_planes(ptr, off, x, mask, plane, SPLIT: tl.constexpr, UPCAST: tl.constexpr):
    # x fp32 -> ptr[off] (fp32), or its bf16 hi at ptr[off] and lo at ptr[plane + off] when SPLIT
    if SPLIT:
        hi, lo = _split(x, UPCAST)
        tl.store(ptr + off, hi, mask=mask)
        tl.store(ptr + plane + off, lo, mask=mask)
    else:
        tl.store(ptr + off, x, mask=mask)


@triton.jit
def _planes_dot(ptr, off, mask, plane, b, TRANS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # X @ b (X^T @ b when TRANS) for the [R, BK] tile X that _store_planes wrote at ptr[off]
    x = tl.load(ptr + off, mask=mask, other=0.0)
    if TRANS:
        x = tl.trans(x)
    if PREC == "bf16x3":
        xl = tl.load(ptr + plane + off, mask=mask, other=0.0)
        if TRANS:
            xl = tl.trans(xl)
        acc = _dot3(x, xl, b, UPCAST)
    else:
        acc = tl.dot(x, b, input_precision=PREC)
    return acc


@triton.jit
def _rows(ptr, rows, rmask, s0, cols, cmask):
    # -> [len(rows), len(cols)] fp32 of ptr[rows * s0 + cols], zero where masked
    off = rows.to(tl.int64)[:, None] * s0 + cols[None, :]
    return tl.load(ptr + off, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _l2n(x, scale):
    # rows of x [R, D] / sqrt(|row|^2 + 1e-6) * scale
    return x * (tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6) * scale)[:, None]


@triton.jit
def _inv_unit_lower(kk, b, c, C: tl.constexpr, B: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # kk [C, C] = K K^T, b, c [C] -> (I + A)^-1 [C, C] for A[i, j] = b_i e^(c_i - c_j) kk[i, j] (j < i)
    r = tl.arange(0, C)
    rb = r // B
    lower = r[:, None] > r[None, :]
    A = tl.where(lower, b[:, None] * tl.exp(tl.where(lower, c[:, None] - c[None, :], 0.0)) * kk, 0.0)
    # the B x B diagonal blocks D = I + A_d: all inverted at once, row i of every block per step
    upper = r[:, None] < r[None, :]
    same = rb[:, None] == rb[None, :]
    Adt = tl.where(upper & same, b[None, :] * tl.exp(tl.where(upper, c[None, :] - c[:, None], 0.0)) * kk, 0.0)
    T = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, B):
        a = tl.sum(tl.where(r[None, :] % B == i, Adt, 0.0), axis=1)  # [C] A[i of j's block, j] over j
        row = tl.sum(a[:, None] * T, axis=0)  # [C] the update of row i of each block
        T = tl.where((r[:, None] % B == i) & same, T - row[None, :], T)
    # I + A = D (I + N), N = D^-1 A_offdiag strictly block-lower: (I + N)^-1 = prod_m (I + (-N)^(2^m))
    P = -_xdot(T, tl.where(same, 0.0, A), PREC, UPCAST)
    for m in tl.static_range(C // B):  # the first log2(C / B) steps act
        if (1 << m) < C // B:
            T = T + _xdot(P, T, PREC, UPCAST)
            if (2 << m) < C // B:
                P = _xdot(P, P, PREC, UPCAST)
    return T


@triton.jit(do_not_specialize=["T"])
def _prep_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cu_ptr, w_ptr, u_ptr, ke_ptr, qe_ptr, a_ptr, c_ptr,
    alog_ptr, dtb_ptr, sq0, sq1, sk0, sk1, sv0, sv1, sg0, sb0, T, scale,
    HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, B: tl.constexpr, VARLEN: tl.constexpr,
    SPREC: tl.constexpr, OPREC: tl.constexpr, UPCAST: tl.constexpr, GATED: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
):
    pdl.wait(USE_PDL)
    # q, k: [T, Hk, DK]; v: [T, HV, DV]; g: [T, HV] fp32; beta: [T, HV]; cu: [N+1] int32
    # GATED: g, beta hold the raw projections a, b; g = -exp(A_log) softplus(a + dt_bias) and
    # beta = sigmoid(b) (rounded to b's dtype) as `reference.gdn_gating` (the decode kernel's form)
    # writes at the chunk's rows: w, ke [T, HV, DK] fp32 (SPREC bf16x3: [2, T, HV, DK] bf16 hi, lo);
    # u [T, HV, DV] fp32; qe [T, HV, DK]; a [T, HV, C] (row i, chunk column j: q_i.k_j e^(c_i - c_j)
    # for j <= i, else 0); c [T, HV] fp32
    j = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    bos, eos = _seq_bounds(cu_ptr, n, T, VARLEN)
    t0 = bos + j * C
    if t0 >= eos:
        return
    hk = h // REP
    r = tl.arange(0, C)
    rows = t0 + r  # [C]
    rm = rows < eos
    r64 = rows.to(tl.int64)
    kc = tl.arange(0, BK)
    km = kc < DK
    vc = tl.arange(0, BV)
    vm = vc < DV
    kmask = rm[:, None] & km[None, :]
    plane = T.to(tl.int64) * (HV * DK)

    k = _l2n(_rows(k_ptr + hk * sk1, rows, rm, sk0, kc, km), 1.0)  # [C, BK]
    if GATED:
        av = tl.load(g_ptr + r64 * sg0 + h, mask=rm, other=0.0).to(tl.float32)
        av += tl.load(dtb_ptr + h).to(tl.float32)
        softplus = tl.where(av > 20.0, av, tl.log(1.0 + tl.exp(av)))
        g = tl.where(rm, -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus, 0.0)  # [C]; pads 0
        bb = tl.load(beta_ptr + r64 * sb0 + h, mask=rm, other=0.0).to(tl.float32)
        b = tl.where(rm, tl.sigmoid(bb).to(beta_ptr.dtype.element_ty).to(tl.float32), 0.0)
    else:
        g = tl.load(g_ptr + r64 * sg0 + h, mask=rm, other=0.0)  # [C]
        b = tl.load(beta_ptr + r64 * sb0 + h, mask=rm, other=0.0).to(tl.float32)
    c = tl.cumsum(g, axis=0)
    c_last = tl.sum(tl.where(r == C - 1, c, 0.0), axis=0)  # c of the last valid row (pads add g = 0)
    tl.store(c_ptr + r64 * HV + h, c, mask=rm)
    kk = _xdot(k, tl.trans(k), SPREC, UPCAST)
    tinv = _inv_unit_lower(kk, b, c, C, B, SPREC, UPCAST)  # [C, C]

    krow = r64[:, None] * (HV * DK) + h * DK + kc[None, :]
    w = _xdot(tinv, k * (b * tl.exp(c))[:, None], SPREC, UPCAST)  # [C, BK]
    _store_planes(w_ptr, krow, w, kmask, plane, SPREC == "bf16x3", UPCAST)
    _store_planes(ke_ptr, krow, k * tl.exp(c_last - c)[:, None], kmask, plane, SPREC == "bf16x3", UPCAST)
    v = _rows(v_ptr + h * sv1, rows, rm, sv0, vc, vm)  # [C, BV]
    u = _xdot(tinv, v * b[:, None], SPREC, UPCAST)
    tl.store(u_ptr + r64[:, None] * (HV * DV) + h * DV + vc[None, :], u, mask=rm[:, None] & vm[None, :])

    q = _l2n(_rows(q_ptr + hk * sq1, rows, rm, sq0, kc, km), scale)
    tl.store(qe_ptr + krow, _to(q * tl.exp(c)[:, None], qe_ptr.dtype.element_ty, UPCAST), mask=kmask)
    incl = r[:, None] >= r[None, :]
    a = _xdot(q, tl.trans(k), OPREC, UPCAST)
    a = tl.where(incl, a * tl.exp(tl.where(incl, c[:, None] - c[None, :], 0.0)), 0.0)
    a_ptrs = a_ptr + r64[:, None] * (HV * C) + h * C + r[None, :]
    tl.store(a_ptrs, _to(a, a_ptr.dtype.element_ty, UPCAST), mask=rm[:, None])


@triton.jit(do_not_specialize=["T"])
def _scan_kernel(
    w_ptr, u_ptr, ke_ptr, qe_ptr, a_ptr, c_ptr, cu_ptr, init_ptr, final_ptr, slots_ptr, has_ptr, out_ptr,
    T,
    HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, VARLEN: tl.constexpr, SLOTS: tl.constexpr,
    SPREC: tl.constexpr, OPREC: tl.constexpr, UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl.wait(USE_PDL)
    # w, u, ke, qe, a, c: from _prep_kernel; init/final: [S, HV, DK, DV] fp32/bf16 (the same tensor when
    # SLOTS, else slot 0 of each); slots: [N] int64; has: [N] uint8; out: [T, HV, DV]
    n = tl.program_id(0)
    h = tl.program_id(1)
    bos, eos = _seq_bounds(cu_ptr, n, T, VARLEN)
    if SLOTS:
        slot = tl.load(slots_ptr + n).to(tl.int64)
        n_k = DK * tl.load(has_ptr + n).to(tl.int32)  # DK when the slot holds state, else 0
    else:
        slot = 0
        n_k = DK
    kc = tl.arange(0, BK)
    km = kc < DK
    vc = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = vc < DV
    ci = tl.arange(0, C)
    plane = T.to(tl.int64) * (HV * DK)
    QDT: tl.constexpr = qe_ptr.dtype.element_ty

    s_off = (slot * HV + h) * (DK * DV) + kc[:, None] * DV + vc[None, :]  # [BK, BV]
    S = tl.load(init_ptr + s_off, mask=(kc < n_k)[:, None] & vm[None, :], other=0.0).to(tl.float32)
    for t0 in range(bos, eos, C):
        rows = t0 + ci  # [C]
        rm = rows < eos
        r64 = rows.to(tl.int64)
        decay = tl.exp(tl.load(c_ptr + (tl.minimum(t0 + C, eos) - 1).to(tl.int64) * HV + h))
        krow = r64[:, None] * (HV * DK) + h * DK + kc[None, :]  # [C, BK]
        kmask = rm[:, None] & km[None, :]
        vrow = r64[:, None] * (HV * DV) + h * DV + vc[None, :]  # [C, BV]
        vmask = rm[:, None] & vm[None, :]
        qe = tl.load(qe_ptr + krow, mask=kmask, other=0.0)
        a = tl.load(a_ptr + r64[:, None] * (HV * C) + h * C + ci[None, :], mask=rm[:, None], other=0.0)
        u = tl.load(u_ptr + vrow, mask=vmask, other=0.0)
        u -= _planes_dot(w_ptr, krow, kmask, plane, S, False, SPREC, UPCAST)  # [C, BV]
        if QDT == tl.float32:
            o = tl.dot(a, u, tl.dot(qe, S, input_precision=OPREC), input_precision=OPREC)  # [C, BV]
        else:
            o = _mma(qe, _to(S, QDT, UPCAST), tl.zeros((C, BV), dtype=tl.float32), UPCAST)
            o = _mma(a, _to(u, QDT, UPCAST), o, UPCAST)
        S = S * decay + _planes_dot(ke_ptr, krow, kmask, plane, u, True, SPREC, UPCAST)
        tl.store(out_ptr + vrow, _to(o, out_ptr.dtype.element_ty, UPCAST), mask=vmask)
    tl.store(final_ptr + s_off, S.to(final_ptr.dtype.element_ty), mask=km[:, None] & vm[None, :])


def _check_inputs(q, k, v, g, beta, gated: bool = False) -> None:
    T, Hk, Dk = q.shape
    assert k.shape == q.shape and v.dim() == 3 and v.shape[0] == T, (q.shape, k.shape, v.shape)
    Hv = v.shape[1]
    assert Hv % Hk == 0, (Hv, Hk)
    for t in (q, k, v):
        assert t.stride(2) == 1, "q, k, v: last dim must be contiguous"
        assert t.dtype in _TL_DTYPES, t.dtype
    g_ok = g.dtype in _TL_DTYPES if gated else g.dtype == torch.float32  # gated: the raw a
    assert g.shape == (T, Hv) and g_ok and g.stride(1) == 1, (g.shape, g.dtype)
    assert beta.shape == (T, Hv) and beta.stride(1) == 1 and beta.dtype in _TL_DTYPES, beta.dtype


def _launch(q, k, v, g, beta, cu, init, final, slots, has, out, n_seqs: int, max_len: int,
            cfg: PrefillConfig, gating: tuple | None = None) -> None:
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    if T == 0:
        final.copy_(init)
        return
    sprec, oprec = cfg.state_prec, cfg.out_prec or ("bf16" if v.element_size() == 2 else "tf32x3")
    assert sprec in ("bf16x3", "tf32", "tf32x3", "ieee") and oprec in ("bf16", "tf32", "tf32x3", "ieee")
    nb = CHUNK // cfg.sub_block
    assert CHUNK % cfg.sub_block == 0 and nb & (nb - 1) == 0, cfg.sub_block
    dev = q.device
    split = torch.bfloat16 if sprec == "bf16x3" else torch.float32
    w = torch.empty(2 if sprec == "bf16x3" else 1, T, Hv, Dk, dtype=split, device=dev)  # workspaces
    ke = torch.empty_like(w)
    u = torch.empty(T, Hv, Dv, dtype=torch.float32, device=dev)
    c = torch.empty(T, Hv, dtype=torch.float32, device=dev)
    qe = torch.empty(T, Hv, Dk, dtype=torch.bfloat16 if oprec == "bf16" else torch.float32, device=dev)
    a = torch.empty(T, Hv, CHUNK, dtype=qe.dtype, device=dev)
    bk, bva = max(16, triton.next_power_of_2(Dk)), max(16, triton.next_power_of_2(Dv))
    bv = max(16, min(cfg.block_v, bva))
    varlen, upcast = cu is not None, interpreting()
    cu = cu if varlen else q
    common = dict(HV=Hv, DK=Dk, DV=Dv, BK=bk, C=CHUNK, VARLEN=varlen, SPREC=sprec, OPREC=oprec, UPCAST=upcast)
    if max_len > 0:
        _prep_kernel[(triton.cdiv(max_len, CHUNK), n_seqs, Hv)](
            q, k, v, g, beta, cu, w, u, ke, qe, a, c, *(gating or (g, g)),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), beta.stride(0), T, Dk**-0.5,
            REP=Hv // Hk, BV=bva, B=cfg.sub_block, GATED=gating is not None, **common,
            num_warps=cfg.prep_warps, **pdl.kw(),
        )
    use_slots = slots is not None
    _scan_kernel[(n_seqs, Hv, triton.cdiv(Dv, bv))](
        w, u, ke, qe, a, c, cu, init, final, slots if use_slots else cu, has if use_slots else cu, out, T,
        BV=bv, SLOTS=use_slots, **common, num_warps=cfg.scan_warps, num_stages=cfg.scan_stages, **pdl.kw(),
    )


def gdn_prefill(
    q: torch.Tensor,  # [L, Hk, Dk]
    k: torch.Tensor,  # [L, Hk, Dk]
    v: torch.Tensor,  # [L, Hv, Dv]
    g: torch.Tensor,  # [L, Hv] fp32 log decay (<= 0)
    beta: torch.Tensor,  # [L, Hv]
    initial_state: torch.Tensor,  # [Hv, Dk, Dv] fp32
    cfg: PrefillConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over one sequence. -> (out [L, Hv, Dv] in v's dtype, final state fp32)."""
    _check_inputs(q, k, v, g, beta)
    L, Hv, Dv = v.shape
    Dk = q.shape[2]
    assert initial_state.shape == (Hv, Dk, Dv) and initial_state.dtype == torch.float32, initial_state.shape
    init = initial_state.contiguous()
    out = torch.empty(L, Hv, Dv, dtype=v.dtype, device=v.device)
    final = torch.empty_like(init)
    _launch(q, k, v, g, beta, None, init, final, None, None, out, 1, L, cfg or CONFIG)
    return out, final


def gdn_prefill_varlen(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] fp32 log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv]
    cu_seqlens: torch.Tensor,  # [N+1] int32 (device): sequence n is rows cu[n]:cu[n+1]
    ssm_state: torch.Tensor,  # [S, Hv, Dk, Dv] fp32/bf16: initial states read, final written at `slots`
    slots: torch.Tensor,  # [N] int64
    has_state: torch.Tensor,  # [N] bool; False: the sequence starts from a zero state
    max_seqlen: int,  # host int >= every cu[n+1] - cu[n] (sizes the prep grid)
    out: torch.Tensor | None = None,  # [T, Hv, Dv] written at rows cu[0]:cu[N] only
    cfg: PrefillConfig | None = None,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,  # (A_log, dt_bias [Hv]): g, beta are raw a, b
) -> torch.Tensor:
    """`gdn_prefill` over N sequences in two launches, states in place. -> out [T, Hv, Dv] (v's dtype).

    cu_seqlens may start past 0 (rows outside cu[0]:cu[N] are neither read nor written), so q, k, v,
    g, beta and out can be the whole step's tensors. No host synchronisation; graph-capturable.
    With `gating`, g and beta are the raw projections a, b and the prep kernel computes the gates
    (`reference.gdn_gating`): no separate launches for them.
    """
    _check_inputs(q, k, v, g, beta, gated=gating is not None)
    T, Hv, Dv = v.shape
    Dk = q.shape[2]
    N = slots.shape[0]
    assert cu_seqlens.shape == (N + 1,) and cu_seqlens.dtype == torch.int32, cu_seqlens.dtype
    assert cu_seqlens.is_contiguous() and cu_seqlens.device == q.device, cu_seqlens.device
    assert ssm_state.dtype in gdn_decode.STATE_DTYPES and ssm_state.is_contiguous(), ssm_state.dtype
    assert ssm_state.dim() == 4 and ssm_state.shape[1:] == (Hv, Dk, Dv), (ssm_state.shape, Hv, Dk, Dv)
    assert slots.dtype == torch.int64 and slots.is_contiguous(), slots.dtype
    assert has_state.shape == (N,) and has_state.dtype == torch.bool, (has_state.shape, has_state.dtype)
    if out is None:
        out = torch.empty(T, Hv, Dv, dtype=v.dtype, device=v.device)
    assert out.shape == (T, Hv, Dv) and out.is_contiguous() and out.dtype in _TL_DTYPES, out.shape
    if N == 0 or T == 0:
        return out
    if gating is not None:
        A_log, dt_bias = gating
        assert A_log.shape == dt_bias.shape == (Hv,) and A_log.is_contiguous() and dt_bias.is_contiguous()
    if max_seqlen <= gdn_decode.RECURRENT_MAX_T:  # short chunks (verifies): the decode update in a loop
        return gdn_decode.gdn_recurrent_varlen(q, k, v, g, beta, cu_seqlens, ssm_state, slots,
                                               has_state.contiguous(), out, gating)
    has = has_state.contiguous().view(torch.uint8)
    _launch(q, k, v, g, beta, cu_seqlens, ssm_state, ssm_state, slots, has, out, N, max_seqlen, cfg or CONFIG,
            gating)
    return out
