"""Causal GQA attention of a step's query tokens over the paged KV cache.

Decode rows (the first `num_decodes` sequences, one query each): flash-decoding. Each program takes
one (sequence, KV head, split) and all G = Hq / Hkv query heads of that KV head, so every K/V row
is read once per KV head. A sequence's context is cut into num_splits equal parts on the device;
the split count depends only on host ints (num_decodes, the block-table width), so the launch is
CUDA-graph capturable. A reduce kernel merges the splits by their log-sum-exp.

Prefill rows: varlen flash attention over the paged cache. A program takes BLOCK_M query tokens of
one sequence times the G heads of one KV head (BLOCK_M * G rows); query i of a sequence sits at
position seq_len - q_len + i and sees keys 0..that position. Online softmax, fp32 accumulators.
Short chunks over long contexts (a speculative verify: one query block per KV head) can split the
keys too, merged by the decode reduce kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from metainfer.forward_meta import ForwardMeta
from metainfer.kernels import pdl
from metainfer.kernels.common import interpreting

_LOG2E = 1.4426950408889634


@dataclass
class DecodeConfig:
    block_n: int = 64  # keys per inner step
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int = 264  # about 2 programs per SM on the 132-SM H200
    min_split_tokens: int = 64  # no split shorter than this (at the block-table capacity)
    max_splits: int = 128
    reduce_chunk: int = 32  # splits merged per step of the reduce kernel


@dataclass
class PrefillConfig:
    block_rows: int = 128  # query rows per program: BLOCK_M tokens x G heads (K/V reuse per load)
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2


DECODE = DecodeConfig()
PREFILL = PrefillConfig()


@triton.jit
def _mma(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST only under TRITON_INTERPRET, whose dot multiplies bf16 bit patterns as integers
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _gated(o, gate_ptr, off, mask, DT: tl.constexpr, GATE: tl.constexpr):
    """o in DT, times sigmoid(gate) (each rounded to DT first, as torch's o * sigmoid(gate)) when GATE."""
    if GATE:
        s = tl.sigmoid(tl.load(gate_ptr + off, mask=mask, other=0.0).to(tl.float32))
        return (o.to(DT).to(tl.float32) * s.to(DT).to(tl.float32)).to(DT)
    return o.to(DT)


@triton.jit
def _store_result(acc, m, lsum, rid, heads, d, mask, lmask, split, num_splits, out_ptr, so_t, so_h,
                  gate_ptr, sg_t, sg_h, part_o_ptr, part_lse_ptr, HQ: tl.constexpr, D: tl.constexpr,
                  SPLIT: tl.constexpr, GATE: tl.constexpr):
    """acc / lsum of query rows (row ids `rid`: a scalar or a column, `heads`): with SPLIT, split
    `split`'s partial output and log-sum-exp (log2 units; -inf where it saw no key) into part_o /
    part_lse [rows, HQ, num_splits(, D)]; else, gated, into out."""
    nonempty = lsum > 0
    o = acc / tl.where(nonempty, lsum, 1.0)[:, None]
    if SPLIT:
        part = (rid * HQ + heads) * num_splits + split
        tl.store(part_o_ptr + part[:, None] * D + d[None, :], o, mask=mask & nonempty[:, None])
        lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, lsum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=lmask)
    else:
        rows = rid if rid.numel == 1 else rid[:, None]
        off = rows * sg_t + heads[:, None] * sg_h + d[None, :]
        o = _gated(o, gate_ptr, off, mask, out_ptr.dtype.element_ty, GATE)
        tl.store(out_ptr + rows * so_t + heads[:, None] * so_h + d[None, :], o, mask=mask)


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys a decode split takes of a seq_len-key row: its share in whole BLOCK_N steps."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _split_range(seq_lens_ptr, b, split, num_splits, BLOCK_N: tl.constexpr):
    """Sequence b's length and split `split`'s share [start, end) of its keys."""
    seq_len = tl.load(seq_lens_ptr + b)
    per = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * per
    return seq_len, start, tl.minimum(start + per, seq_len)


@triton.jit
def _kv_rows(bt_ptr, b, sbt, tok, nmask, hkv, sk_blk, sk_tok, sk_h, BLOCK_SIZE: tl.constexpr):
    """Cache offsets of tokens `tok` of sequence b, KV head hkv, through its block table."""
    blk = tl.load(bt_ptr + b * sbt + tok // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    return blk * sk_blk + (tok % BLOCK_SIZE) * sk_tok + hkv * sk_h  # [BLOCK_N]


@triton.jit
def _attend(q, kt, vt, visible, m, lsum, acc, scale_log2, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One tile of keys (kt [BLOCK_D, BLOCK_N], vt [BLOCK_N, BLOCK_D]; visible [rows, BLOCK_N]) into
    the online softmax of q's rows (m, lsum, acc; a row that has seen no key keeps m = -inf)."""
    sc = _mma(q, kt, PREC, UPCAST) * scale_log2  # [rows, BLOCK_N]
    sc = tl.where(visible, sc, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(sc - m_safe[:, None])
    lsum = lsum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _mma(p.to(vt.dtype), vt, PREC, UPCAST)
    return m_new, lsum, acc


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, gate_ptr,
    sq_t, sq_h, so_t, so_h, sg_t, sg_h, sk_blk, sk_tok, sk_h, sbt, scale_log2, num_splits,
    HQ: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, GATE: tl.constexpr = 0, USE_PDL: tl.constexpr = 0,
):
    # q: [B, HQ, D] rows of the decodes; caches: [N, BLOCK_SIZE, Hkv, D]; bt: [B, max_blocks]
    # SPLIT: part_o [B, HQ, num_splits, D] fp32, part_lse [B, HQ, num_splits] fp32 (log2 units);
    # else (num_splits == 1) the result goes straight to out [B, HQ, D]
    pdl.wait(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    seq_len, start, end = _split_range(seq_lens_ptr, b, split, num_splits, BLOCK_N)

    g = tl.arange(0, G_PAD)
    gmask = g < G
    heads = hkv * G + g
    qrows = q_ptr + b * sq_t + heads[:, None] * sq_h
    q = tl.load(qrows + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)  # [G_PAD, BLOCK_D]
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    for s in range(start, end, BLOCK_N):
        tok = s + tl.arange(0, BLOCK_N)
        nmask = tok < end
        row = _kv_rows(bt_ptr, b, sbt, tok, nmask, hkv, sk_blk, sk_tok, sk_h, BLOCK_SIZE)
        kt = tl.load(k_ptr + row[None, :] + d[:, None], mask=dmask[:, None] & nmask[None, :], other=0.0)
        vt = tl.load(v_ptr + row[:, None] + d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
        m, lsum, acc = _attend(q, kt, vt, nmask[None, :], m, lsum, acc, scale_log2, PREC, UPCAST)
    _store_result(acc, m, lsum, b, heads, d, gmask[:, None] & dmask[None, :], gmask, split, num_splits,
                  out_ptr, so_t, so_h, gate_ptr, sg_t, sg_h, part_o_ptr, part_lse_ptr, HQ, D, SPLIT, GATE)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, gate_ptr, so_t, so_h, sg_t, sg_h, num_splits,
    HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
    GATE: tl.constexpr = 0, seq_lens_ptr=None, ACTIVE_N: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
):
    """Merges each (row, head)'s num_splits partial outputs by their log-sum-exps, gated into out.
    ACTIVE_N (decode: the split kernel's BLOCK_N; 0 for prefill splits): only the
    splits that held keys are read, as many as `_split_range` gives the row's length (seq_lens_ptr; the
    split count follows the block-table capacity, so at 1k tokens of an 8k-capacity table 17 of 128),
    and each chunk's log-sum-exps and partial outputs load together, merged by a running max: one
    round trip a chunk (a single chunk: the same sums as the two passes)."""
    pdl.wait(USE_PDL)
    # part_o: [B, HQ, num_splits, D] fp32; part_lse: [B, HQ, num_splits]; out: [B, HQ, D]
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (b * HQ + h) * num_splits
    cs = tl.arange(0, CHUNK)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    if ACTIVE_N:
        seq_len = tl.load(seq_lens_ptr + b)
        n = tl.minimum(tl.cdiv(seq_len, tl.maximum(_split_len(seq_len, num_splits, ACTIVE_N), 1)), num_splits)
        m = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), axis=0)
        total = tl.sum(tl.zeros([CHUNK], tl.float32), axis=0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for c in range(0, n, CHUNK):
            valid = c + cs < n
            lse = tl.load(part_lse_ptr + base + c + cs, mask=valid, other=float("-inf"))
            o = tl.load(part_o_ptr + (base + c + cs)[:, None] * D + d[None, :],
                        mask=valid[:, None] & dmask[None, :], other=0.0)
            o = tl.where((lse > float("-inf"))[:, None], o, 0.0)  # a head that saw no key wrote no output
            m_new = tl.maximum(m, tl.max(lse, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            scale = tl.exp2(m - m_safe)
            w = tl.exp2(lse - m_safe)
            acc = acc * scale + tl.sum(w[:, None] * o, axis=0)
            total = total * scale + tl.sum(w, axis=0)
            m = m_new
    else:
        mv = tl.full([CHUNK], float("-inf"), tl.float32)
        for c in range(0, num_splits, CHUNK):
            lse = tl.load(part_lse_ptr + base + c + cs, mask=c + cs < num_splits, other=float("-inf"))
            mv = tl.maximum(mv, lse)
        m = tl.max(mv, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)  # an empty sequence (padding) yields zeros
        wv = tl.zeros([CHUNK], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for c in range(0, num_splits, CHUNK):
            lse = tl.load(part_lse_ptr + base + c + cs, mask=c + cs < num_splits, other=float("-inf"))
            w = tl.exp2(lse - m)
            used = lse > float("-inf")  # empty splits wrote no partial output
            o = tl.load(part_o_ptr + (base + c + cs)[:, None] * D + d[None, :],
                        mask=used[:, None] & dmask[None, :], other=0.0)
            wv += w
            acc += tl.sum(w[:, None] * o, axis=0)
        total = tl.sum(wv, axis=0)
    acc = acc / tl.where(total > 0, total, 1.0)
    acc = _gated(acc, gate_ptr, b * sg_t + h * sg_h + d, dmask, out_ptr.dtype.element_ty, GATE)
    tl.store(out_ptr + b * so_t + h * so_h + d, acc, mask=dmask)


@triton.jit(do_not_specialize=["seq_offset", "num_splits"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, gate_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, seq_offset,
    sq_t, sq_h, so_t, so_h, sg_t, sg_h, sk_blk, sk_tok, sk_h, sbt, scale_log2, part_o_ptr, part_lse_ptr,
    num_splits,
    HQ: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, GATE: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
):
    pdl.wait(USE_PDL)
    # q, out: [T, HQ, D]; row r of a program is token m0 + r // G_P2, head hkv * G + r % G_P2.
    # SPLIT: program axis 0 is (query block, split); a split takes its share of the block's keys and
    # writes part_o [T, HQ, num_splits, D] / part_lse [T, HQ, num_splits] (log2 units), merged by
    # _decode_reduce_kernel over the token rows (short chunks over long contexts: few query blocks)
    if SPLIT:  # longest causal rows first
        mblk = tl.num_programs(0) // num_splits - 1 - tl.program_id(0) // num_splits
        split = tl.program_id(0) % num_splits
    else:
        mblk = tl.num_programs(0) - 1 - tl.program_id(0)
        split = 0
    i = (seq_offset + tl.program_id(1)).to(tl.int64)
    hkv = tl.program_id(2)
    q_start = tl.load(qsl_ptr + i)
    q_len = tl.load(qsl_ptr + i + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + i)
    ctx = seq_len - q_len
    m0 = mblk * BLOCK_M

    r = tl.arange(0, BLOCK_M * G_P2)
    t = m0 + r // G_P2
    gg = r % G_P2
    rmask = (t < q_len) & (gg < G)
    heads = hkv * G + gg
    tok_row = (q_start + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qmask = rmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + tok_row[:, None] * sq_t + heads[:, None] * sq_h + d[None, :], mask=qmask, other=0.0)
    qpos = ctx + t  # [R]
    hi = tl.where(m0 < q_len, tl.minimum(seq_len, ctx + m0 + BLOCK_M), 0)
    lo = 0
    if SPLIT:  # this split's share of the block's keys, whole BLOCK_N steps
        per = _split_len(hi, num_splits, BLOCK_N)
        lo = split * per
        hi = tl.minimum(lo + per, hi)

    m = tl.full([BLOCK_M * G_P2], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M * G_P2], tl.float32)
    acc = tl.zeros([BLOCK_M * G_P2, BLOCK_D], tl.float32)
    for s in range(lo, hi, BLOCK_N):
        kpos = s + tl.arange(0, BLOCK_N)
        nmask = kpos < hi
        row = _kv_rows(bt_ptr, i, sbt, kpos, nmask, hkv, sk_blk, sk_tok, sk_h, BLOCK_SIZE)
        kt = tl.load(k_ptr + row[None, :] + d[:, None], mask=dmask[:, None] & nmask[None, :], other=0.0)
        vt = tl.load(v_ptr + row[:, None] + d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
        visible = (kpos[None, :] <= qpos[:, None]) & nmask[None, :]
        m, lsum, acc = _attend(q, kt, vt, visible, m, lsum, acc, scale_log2, PREC, UPCAST)
    _store_result(acc, m, lsum, tok_row, heads, d, qmask, rmask, split, num_splits, out_ptr, so_t, so_h,
                  gate_ptr, sg_t, sg_h, part_o_ptr, part_lse_ptr, HQ, D, SPLIT, GATE)


def decode_num_splits(num_decodes: int, num_kv_heads: int, capacity: int, cfg: DecodeConfig) -> int:
    """Splits per sequence from host ints only: enough programs to fill the GPU, none shorter than
    cfg.min_split_tokens at the block-table capacity (max_blocks * block_size)."""
    want = triton.cdiv(cfg.target_programs, max(1, num_decodes * num_kv_heads))
    return max(1, min(want, triton.cdiv(capacity, cfg.min_split_tokens), cfg.max_splits))


def _check(q, k_cache, v_cache, meta: ForwardMeta, gate: torch.Tensor | None = None) -> None:
    assert q.dim() == 3 and q.stride(2) == 1, "q: [T, Hq, D] with contiguous D"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "k/v caches: same strides"
    assert k_cache.dtype == v_cache.dtype == q.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), q.dtype
    assert q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0, (q.shape, k_cache.shape)
    bt = meta.block_tables
    assert bt.dtype == torch.int32 and bt.dim() == 2 and bt.stride(1) == 1, (bt.dtype, bt.shape)
    assert meta.seq_lens.dtype == torch.int32 and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.is_contiguous() and meta.query_start_loc.is_contiguous()
    if gate is not None:
        assert gate.shape == q.shape and gate.dtype == q.dtype and gate.stride(2) == 1, gate.shape


def _gate_args(gate: torch.Tensor | None, out: torch.Tensor) -> tuple:
    """(pointer, token stride, head stride, GATE) for the kernels' output gate."""
    if gate is None:
        return out, 0, 0, 0  # unused pointer
    return gate, gate.stride(0), gate.stride(1), 1


def _decode(q, k_cache, v_cache, meta: ForwardMeta, scale: float, out, cfg: DecodeConfig,
            num_splits: int | None = None, gate: torch.Tensor | None = None) -> None:
    nd = meta.num_decodes
    _, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    bt = meta.block_tables
    ns = num_splits or decode_num_splits(nd, Hkv, bt.shape[1] * bs, cfg)
    if ns > 1:
        part_o = torch.empty(nd, Hq, ns, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(nd, Hq, ns, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    block_d = triton.next_power_of_2(D)
    g_ptr, sg_t, sg_h, has_gate = _gate_args(gate, out)
    _decode_split_kernel[(nd, Hkv, ns)](
        q, k_cache, v_cache, bt, meta.seq_lens, out, part_o, part_lse, g_ptr,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), sg_t, sg_h,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.stride(0), scale * _LOG2E, ns,
        HQ=Hq, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=block_d,
        BLOCK_SIZE=bs, BLOCK_N=cfg.block_n, SPLIT=ns > 1,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreting(), GATE=has_gate,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.kw(),
    )
    if ns > 1:
        _decode_reduce_kernel[(nd, Hq)](
            part_o, part_lse, out, g_ptr, out.stride(0), out.stride(1), sg_t, sg_h, ns,
            HQ=Hq, D=D, BLOCK_D=block_d, CHUNK=cfg.reduce_chunk, GATE=has_gate, seq_lens_ptr=meta.seq_lens,
            ACTIVE_N=cfg.block_n, num_warps=4, **pdl.kw(),
        )


PREFILL_SPLIT_MAX_Q = 16  # the longest chunk that splits (a speculative verify's 1 + K tokens)


def prefill_num_splits(max_q: int, num_kv_heads: int, capacity: int, dcfg: DecodeConfig = DECODE) -> int:
    """KV splits per query block of a prefill step, from host ints only (graph-capturable): 1 for a
    chunk longer than PREFILL_SPLIT_MAX_Q tokens; else as many as one sequence's decode would take
    (enough programs to fill the GPU, none shorter than dcfg.min_split_tokens at the block-table
    capacity) however many sequences the step holds: a sequence's verify rounds alike batched or
    alone."""
    if max_q > PREFILL_SPLIT_MAX_Q:
        return 1
    return decode_num_splits(1, num_kv_heads, capacity, dcfg)


def _prefill(q, k_cache, v_cache, meta: ForwardMeta, scale: float, out, cfg: PrefillConfig,
             gate: torch.Tensor | None = None, num_splits: int | None = None) -> None:
    nd, B = meta.num_decodes, meta.num_seqs
    max_q = meta.prefill_max_len()
    if max_q == 0:
        return
    T, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    g_p2 = triton.next_power_of_2(G)
    block_m = max(1, cfg.block_rows // g_p2)
    bt = meta.block_tables
    ns = num_splits or prefill_num_splits(max_q, Hkv, bt.shape[1] * bs)
    if ns > 1:
        part_o = torch.empty(T, Hq, ns, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(T, Hq, ns, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    g_ptr, sg_t, sg_h, has_gate = _gate_args(gate, out)
    _prefill_kernel[(triton.cdiv(max_q, block_m) * ns, B - nd, Hkv)](
        q, k_cache, v_cache, out, g_ptr, bt, meta.query_start_loc, meta.seq_lens, nd,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), sg_t, sg_h,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.stride(0), scale * _LOG2E,
        part_o, part_lse, ns, HQ=Hq, G=G, G_P2=g_p2, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_SIZE=bs,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, SPLIT=ns > 1,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreting(), GATE=has_gate,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.kw(),
    )
    if ns > 1:  # merge each prefill token row's splits (the step's rows s0.. : views from there)
        s0 = meta.query_start_loc_cpu[nd]
        _decode_reduce_kernel[(T - s0, Hq)](
            part_o[s0:], part_lse[s0:], out[s0:], g_ptr[s0:] if has_gate else out,
            out.stride(0), out.stride(1), sg_t, sg_h, ns, HQ=Hq, D=D, BLOCK_D=triton.next_power_of_2(D),
            CHUNK=DECODE.reduce_chunk, GATE=has_gate, num_warps=4, **pdl.kw(),
        )


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D] normed and rotated; decodes' rows first
    k_cache: torch.Tensor,  # [N, block_size, Hkv, D] already holding this step's keys
    v_cache: torch.Tensor,  # [N, block_size, Hkv, D]
    meta: ForwardMeta,
    scale: float,
    gate: torch.Tensor | None = None,  # [T, Hq, D], D contiguous: the output is o * sigmoid(gate)
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached sequence, times
    sigmoid(gate) when given (applied as the result is stored). -> [T, Hq, D]."""
    _check(q, k_cache, v_cache, meta, gate)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    if meta.num_decodes:
        _decode(q, k_cache, v_cache, meta, scale, out, DECODE, gate=gate)
    if meta.num_seqs > meta.num_decodes:
        _prefill(q, k_cache, v_cache, meta, scale, out, PREFILL, gate=gate)
    return out
