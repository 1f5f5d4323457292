"""Routed experts for many tokens (prefill, large decode batches): the (token, slot) pairs are
bucketed by expert on the device (`_count_kernel`, then `_bucket_kernel`: positions from int
atomics), each bucket padded to BLOCK_M rows inside a buffer of worst-case size
P + min(E, P) * (BLOCK_M - 1). `_grouped_gate_up_kernel` (gate and up tiles of one expert, fused
SiLU*mul) and `_grouped_down_kernel` run over (M-block, N-block) and read each expert's weights
once per M-block; the down kernel writes one row per pair and `routing.combine` sums each token's
k rows with its routing weights in slot order. The order of pairs inside a bucket varies between
runs, but each row is computed independently of its position, so the result does not.

Weights BF16 or FP8 e4m3 with 128x128 block scales. With FP8 weights both GEMMs take e4m3
activations quantised per token and 128 columns (`fp8_linear.act_quant`, the dense prefill GEMM's
scheme) and run e4m3 x e4m3 on the tensor cores, each 128-wide step's product times both scales.
`moe.moe_experts` picks this path by T (`moe.use_pair_path`).

The down kernel's e4m3 input is quantised on the bucketed rows that hold pairs only
(`quant_valid_rows`: tiles past the last bucket and each bucket's padding rows skipped).

Config keys beyond the tiles: TMA=1 loads the weight tiles by TMA descriptor; SWAP=1 computes each
tile transposed, weights @ rows^T, so the weight tile is the MMA's M side and an expert's few rows
its N side. The activations are quantised by `act_quant` once, not inside these kernels (each N
tile would re-quantise the same rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metainfer.kernels import pdl, routing
from metainfer.kernels.common import interpreting, load_tuned, mma, upcast_dots, wdot
from metainfer.kernels.fp8_linear import BLOCK, act_quant, quant_tile
from metainfer.settings import settings


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, P, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    pdl.wait(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    tl.atomic_add(counts_ptr + ids, 1, mask=mask)


@triton.jit
def _bucket_kernel(
    ids_ptr, counts_ptr, cursor_ptr, ends_ptr, sorted_ptr, P, E,
    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """sorted[ends[e] - padded[e] + rank] = pair, padded[e] = counts[e] rounded up to BLOCK_M."""
    pdl.wait(USE_PDL)
    offs_e = tl.arange(0, E_P2)
    cnt = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # [E_P2] inclusive
    if tl.program_id(0) == 0:
        tl.store(ends_ptr + offs_e, ends, mask=offs_e < E)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    rank = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
    pos = tl.gather(ends - padded, ids, 0) + rank
    tl.store(sorted_ptr + pos, offs, mask=mask)


@triton.jit
def _bucket_one_kernel(
    ids_ptr, counts_ptr, ends_ptr, sorted_ptr, P, E,
    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0,
):
    """`_count_kernel` + `_bucket_kernel` in one program for P <= BLOCK pairs (decode batches): the
    counts zeroed here (no memset launch), each pair's rank in its expert from the count's atomic
    add, then the ends and the bucketed pairs as `_bucket_kernel` lays them out."""
    pdl.wait(USE_PDL)
    offs_e = tl.arange(0, E_P2)
    tl.store(counts_ptr + offs_e, tl.zeros((E_P2,), tl.int32), mask=offs_e < E)
    tl.debug_barrier()  # the zeros are in memory before any thread counts
    offs = tl.arange(0, BLOCK)
    mask = offs < P
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    rank = tl.atomic_add(counts_ptr + ids, 1, mask=mask)
    tl.debug_barrier()  # every pair counted before the counts are read
    cnt = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0, cache_modifier=".cg")
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # [E_P2] inclusive
    tl.store(ends_ptr + offs_e, ends, mask=offs_e < E)
    pos = tl.gather(ends - padded, ids, 0) + rank
    tl.store(sorted_ptr + pos, offs, mask=mask)


@triton.jit
def _bucket_rows(ends_ptr, counts_ptr, row0, E, BLOCK_M: tl.constexpr, E_P2: tl.constexpr, N: tl.constexpr):
    """-> (expert of padded row row0 (buckets padded to BLOCK_M rows), the valid-row mask of rows
    row0 ... row0 + N - 1 [N], those rows); the N rows lie in one M-block (N divides BLOCK_M,
    row0 % N == 0)."""
    offs_e = tl.arange(0, E_P2)
    ends = tl.load(ends_ptr + offs_e, mask=offs_e < E, other=2147483647)
    e = tl.minimum(tl.sum((ends <= row0).to(tl.int32)), E - 1)
    cnt = tl.load(counts_ptr + e)
    start = tl.load(ends_ptr + e) - (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    rows = row0 + tl.arange(0, N)
    return e.to(tl.int64), (rows - start) < cnt, rows


@triton.jit
def _block_expert(ends_ptr, counts_ptr, row0, E, BLOCK_M: tl.constexpr, E_P2: tl.constexpr):
    """-> (expert of the M-block starting at padded row row0, its valid-row mask [BLOCK_M], its
    rows [BLOCK_M])."""
    return _bucket_rows(ends_ptr, counts_ptr, row0, E, BLOCK_M, E_P2, BLOCK_M)


@triton.jit
def _valid_rows_quant_kernel(x_ptr, q_ptr, s_ptr, ends_ptr, counts_ptr, T, K, E,
                             BLOCK_M: tl.constexpr, E_P2: tl.constexpr, BLOCK_T: tl.constexpr,
                             USE_PDL: tl.constexpr = 0):
    """`fp8_linear.act_quant` of the gate/up kernel's bucketed output [T padded rows, K], its valid
    rows only: tiles past the last bucket return at once and each bucket's padding rows are left
    unwritten (the down kernel masks their rows and scales). The valid rows' q and s are act_quant's."""
    pdl.wait(USE_PDL)
    t0 = tl.program_id(0) * BLOCK_T
    if t0 >= tl.load(ends_ptr + E - 1):
        return
    _, valid, offs_t = _bucket_rows(ends_ptr, counts_ptr, t0, E, BLOCK_M, E_P2, BLOCK_T)
    quant_tile(x_ptr, q_ptr, s_ptr, offs_t, valid, T, K, K, tl.program_id(1))


@triton.jit
def _swap_dot(a, w, UPCAST: tl.constexpr, SWAP: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] (rows) times w [BLOCK_N, BLOCK_K] (weight rows), transposed: -> fp32
    [BLOCK_M, BLOCK_N], or with SWAP its transpose [BLOCK_N, BLOCK_M] from w @ a^T (the weights the
    MMA's M side, the few rows per expert its N side). Exact operands: w is converted to a's dtype."""
    if SWAP:
        out = wdot(w, tl.trans(a), UPCAST, 0)
    else:
        out = mma(a, tl.trans(w), UPCAST)
    return out


@triton.jit
def _scaled_dot(a, w, sa, sw, UPCAST: tl.constexpr, SWAP: tl.constexpr):
    """`_swap_dot` of one 128-wide K step times its scales: sa [BLOCK_M] per row, sw [BLOCK_N] per
    weight row (the block scale)."""
    if SWAP:
        out = _swap_dot(a, w, UPCAST, SWAP) * (sw[:, None] * sa[None, :])
    else:
        out = _swap_dot(a, w, UPCAST, SWAP) * (sa[:, None] * sw[None, :])
    return out


@triton.jit
def _store_rows(out_ptr, acc, rows, valid, offs_n, n_mask, N, SWAP: tl.constexpr):
    """out[rows, offs_n] <- acc ([BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] with SWAP) on valid rows."""
    if SWAP:
        tl.store(out_ptr + rows[None, :] * N + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[None, :] & n_mask[:, None])
    else:
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & n_mask[None, :])


# n_xs (the scales' row stride: the step's token count, or act_rows of it) is not specialised on % 16: the
# scales are gathered by token id, so it buys nothing, and a variant per residue would compile while serving
# (a step whose token count the warmup did not make waits on the compiler)
@triton.jit(do_not_specialize=["n_xs"])
def _grouped_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, sorted_ptr, ends_ptr, counts_ptr, act_ptr, H, I, E, stride_we, stride_se, stride_sn,
    xs_ptr, n_xs,
    TOP_K: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr, E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, w_desc=None,
    SWAP: tl.constexpr = 0, USE_PDL: tl.constexpr = 0,
):
    """FP8 (BLOCK_K 128): x holds e4m3 activations with per-(token, 128-column) scales
    xs [H/128, n_xs]; the MMA runs on both e4m3 operands and each step's product takes both scales.
    w_desc (a TMA descriptor over w as [E * 2I, H], block [BLOCK_N, BLOCK_K]; I % BLOCK_N == 0):
    the weight tiles come by TMA instead of pointer loads. SWAP: the MMA computes the transposed
    tile, weights [BLOCK_N, BLOCK_K] as its M side and the expert's rows as N (`_swap_dot`)."""
    pdl.wait(USE_PDL)
    row0 = tl.program_id(0) * BLOCK_M
    if row0 >= tl.load(ends_ptr + E - 1):
        return
    e, valid, rows = _block_expert(ends_ptr, counts_ptr, row0, E, BLOCK_M, E_P2)
    tok = tl.load(sorted_ptr + rows, mask=valid, other=0) // TOP_K  # [BLOCK_M]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    wg_rows = w_ptr + e * stride_we + offs_n[:, None] * H  # [BLOCK_N, 1]; up rows at +I*H
    s_base = s_ptr + e * stride_se
    acc_g = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        a_mask = valid[:, None] & k_mask[None, :]
        a = tl.load(x_ptr + tok[:, None] * H + offs_k[None, :], mask=a_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
        if w_desc is not None:
            g_row = (e * (2 * I) + tl.program_id(1) * BLOCK_N).to(tl.int32)
            wg = w_desc.load([g_row, k0])  # [BLOCK_N, BLOCK_K]
            wu = w_desc.load([g_row + I, k0])
        else:
            wmask = n_mask[:, None] & k_mask[None, :]
            wg = tl.load(wg_rows + offs_k[None, :], mask=wmask, other=0.0)  # [BLOCK_N, BLOCK_K]
            wu = tl.load(wg_rows + I * H + offs_k[None, :], mask=wmask, other=0.0)
        if FP8:  # exact e4m3 operands; the block scale multiplies the step's product
            sg = tl.load(s_base + (offs_n // 128) * stride_sn + k0 // 128, mask=n_mask, other=0.0)
            su = tl.load(s_base + ((offs_n + I) // 128) * stride_sn + k0 // 128, mask=n_mask, other=0.0)
            sa = tl.load(xs_ptr + (k0 // 128) * n_xs + tok, mask=valid, other=0.0)
            acc_g += _scaled_dot(a, wg, sa, sg, UPCAST, SWAP)
            acc_u += _scaled_dot(a, wu, sa, su, UPCAST, SWAP)
        else:
            acc_g += _swap_dot(a, wg, UPCAST, SWAP)
            acc_u += _swap_dot(a, wu, UPCAST, SWAP)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    _store_rows(act_ptr, act, rows, valid, offs_n, n_mask, I, SWAP)


@triton.jit
def _grouped_down_kernel(
    act_ptr, w_ptr, s_ptr, sorted_ptr, ends_ptr, counts_ptr, y_ptr, H, I, E, stride_we, stride_se, stride_sn,
    as_ptr, n_as,
    FP8: tl.constexpr, UPCAST: tl.constexpr, E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, w_desc=None,
    SWAP: tl.constexpr = 0, USE_PDL: tl.constexpr = 0,
):
    """FP8: act holds e4m3 with per-(row, 128-column) scales as [I/128, n_as] (see the gate/up kernel).
    w_desc: a TMA descriptor over w as [E * H, I], block [BLOCK_N, BLOCK_K] (H % BLOCK_N == 0).
    SWAP: as the gate/up kernel's."""
    pdl.wait(USE_PDL)
    row0 = tl.program_id(0) * BLOCK_M
    if row0 >= tl.load(ends_ptr + E - 1):
        return
    e, valid, rows = _block_expert(ends_ptr, counts_ptr, row0, E, BLOCK_M, E_P2)
    pair = tl.load(sorted_ptr + rows, mask=valid, other=0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    w_rows = w_ptr + e * stride_we + offs_n[:, None] * I  # [BLOCK_N, 1]
    s_rows = s_ptr + e * stride_se + (offs_n // 128) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < I
        a_mask = valid[:, None] & k_mask[None, :]
        a = tl.load(act_ptr + rows[:, None] * I + offs_k[None, :], mask=a_mask, other=0.0)
        if w_desc is not None:
            w = w_desc.load([(e * H + tl.program_id(1) * BLOCK_N).to(tl.int32), k0])  # [BLOCK_N, BLOCK_K]
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if FP8:
            sb = tl.load(s_rows + k0 // 128, mask=n_mask, other=0.0)
            sa = tl.load(as_ptr + (k0 // 128) * n_as + rows, mask=valid, other=0.0)
            acc += _scaled_dot(a, w, sa, sb, UPCAST, SWAP)
        else:
            acc += _swap_dot(a, w, UPCAST, SWAP)
    _store_rows(y_ptr, acc, pair, valid, offs_n, n_mask, H, SWAP)


# ---- launchers -----------------------------------------------------------------------------------
def quant_valid_rows(act, ends, counts, bm: int, e_p2: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) as `act_quant(act)` gives them on the valid rows of the bucketed [padded rows, I]
    activations (ends / counts: the bucketing's); the padding rows' q and s are left unset."""
    R, K = act.shape
    q = torch.empty(R, K, dtype=torch.float8_e4m3fn, device=act.device)
    s = torch.empty(triton.cdiv(K, BLOCK), R, dtype=torch.float32, device=act.device)
    bt = min(16, bm)
    _valid_rows_quant_kernel[(triton.cdiv(R, bt), triton.cdiv(K, BLOCK))](
        act, q, s, ends, counts, R, K, ends.shape[0], BLOCK_M=bm, E_P2=e_p2, BLOCK_T=bt, **pdl.kw())
    return q, s


def grouped_key(T: int, top_k: int, E: int, fp8: bool) -> str:
    """The tuned-table key: weights' kind and the heuristic M-block size for the mean rows per
    expert (a tuned config may pick another M-block size; the key stays the heuristic's)."""
    rows = T * top_k / E
    bm = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 96 else 128
    return f"grouped:{'fp8' if fp8 else 'bf16'}:{bm}"


def grouped_config(T: int, top_k: int, E: int, fp8: bool = False) -> dict:
    """Tile sizes by the mean rows per expert (decode batches: 16-row M-blocks, little padding): the H200
    table's entry for the key, else the heuristic (at 16-row blocks 128-wide N tiles for BF16, 32/64 for
    FP8)."""
    key = grouped_key(T, top_k, E, fp8)
    bm = int(key.rsplit(":", 1)[1])
    hit = load_tuned("moe_pair", settings().moe_tuned).get(key)
    if hit is not None:  # measured per M-block size (benchmarks/sweep_decode_kernels.py --grouped-tokens)
        return dict(hit)
    if bm == 16:
        gn, dn = (32, 64) if fp8 else (128, 128)
        return dict(BLOCK_M=16, GU_BLOCK_N=gn, DN_BLOCK_N=dn, BLOCK_K=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=bm, GU_BLOCK_N=64, DN_BLOCK_N=128 if bm >= 64 else 64, BLOCK_K=64,
                num_warps=4 if bm <= 32 else 8, num_stages=3)


def grouped_path(x, w_gate_up, w_down, tw, ids, gu, dn, fp8: bool, out, cfg: dict) -> None:
    """out [T, H] <- the experts of every (token, slot) pair (`grouped_rows`), then their weighted
    sum (`routing.combine`)."""
    routing.combine(grouped_rows(x, w_gate_up, w_down, ids, gu, dn, fp8, cfg), tw, out)


def tma_ok(w_gate_up: torch.Tensor, w_down: torch.Tensor, gu_n: int, dn_n: int) -> bool:
    """Whether a config's TMA=1 applies: contiguous weights, N tiles that divide each expert's rows
    (a tile never straddles two experts; past K the descriptor reads zeros); a CUDA device with TMA
    (sm_90+) or the interpreter."""
    E, I2, H = w_gate_up.shape
    ok = w_gate_up.is_contiguous() and w_down.is_contiguous() and (I2 // 2) % gu_n == 0 and H % dn_n == 0
    if w_gate_up.device.type == "cuda":
        return ok and torch.cuda.get_device_capability(w_gate_up.device)[0] >= 9
    return ok and interpreting()


def _desc(w: torch.Tensor, block_n: int, block_k: int):
    """A TMA descriptor over the expert weights [E, N, K] as [E * N, K], block [block_n, block_k]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, N, K = w.shape
    return TensorDescriptor(w, [E * N, K], [K, 1], [block_n, block_k])


BUCKET_ONE_MAX = 1024  # pairs `_bucket_one_kernel` buckets in one program (<= its BLOCK); more: two launches


def grouped_rows(x, w_gate_up, w_down, ids, gu, dn, fp8: bool, cfg: dict, xq=None) -> torch.Tensor:
    """Each (token, slot) pair's expert output, unweighted, in x's dtype: bucket the pairs by
    expert, the two grouped GEMMs. -> [T*k, H] in pair order (token-major). gu, dn: (scales, expert
    stride, row stride) of the FP8 scales (`moe._scale_args`); cfg: `grouped_config`'s; xq: x's e4m3
    copy (q [Tp >= T, H], s [H/128, Tp]) from the norm that wrote x, in act_quant's place."""
    T, H = x.shape
    E, k, I = w_gate_up.shape[0], ids.shape[1], w_down.shape[2]
    P, bm = T * k, cfg["BLOCK_M"]
    max_blocks = (P + min(E, P) * (bm - 1)) // bm
    e_p2 = triton.next_power_of_2(E)
    upcast = upcast_dots(x)
    dev = x.device
    ends = torch.empty(E, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(max_blocks * bm, dtype=torch.int32, device=dev)
    blk = 1024
    if P <= BUCKET_ONE_MAX:  # one launch, no memset
        counts = torch.empty(E, dtype=torch.int32, device=dev)
        _bucket_one_kernel[(1,)](ids, counts, ends, sorted_pairs, P, E, BLOCK_M=bm, E_P2=e_p2, BLOCK=blk,
                                 num_warps=8, **pdl.kw())
    else:
        counts = torch.zeros(2 * E, dtype=torch.int32, device=dev)  # [counts | cursor]
        _count_kernel[(triton.cdiv(P, blk),)](ids, counts, P, BLOCK=blk, **pdl.kw())
        _bucket_kernel[(triton.cdiv(P, blk),)](ids, counts, counts[E:], ends, sorted_pairs, P, E,
                                               BLOCK_M=bm, E_P2=e_p2, BLOCK=blk, **pdl.kw())
    act = torch.empty(max_blocks * bm, I, dtype=x.dtype, device=dev)  # [padded rows, I], bucket order
    if not fp8:
        xa, xs = x, x  # x itself (the scales unused)
    elif xq is not None:
        xa, xs = xq
        assert xa.shape[1] == H and xa.shape[0] >= T and xs.shape[1] == xa.shape[0], (xa.shape, xs.shape, T)
    else:
        xa, xs = act_quant(x)  # e4m3 activations + scales
    common = dict(E_P2=e_p2, BLOCK_M=bm, BLOCK_K=128 if fp8 else cfg["BLOCK_K"], FP8=fp8, UPCAST=upcast,
                  SWAP=int(cfg.get("SWAP", 0)), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    bk = common["BLOCK_K"]
    tma = cfg.get("TMA", 0) and tma_ok(w_gate_up, w_down, cfg["GU_BLOCK_N"], cfg["DN_BLOCK_N"])
    _grouped_gate_up_kernel[(max_blocks, triton.cdiv(I, cfg["GU_BLOCK_N"]))](
        xa, w_gate_up, gu[0], sorted_pairs, ends, counts, act, H, I, E, w_gate_up.stride(0), gu[1], gu[2],
        xs, xs.shape[-1], TOP_K=k, BLOCK_N=cfg["GU_BLOCK_N"], **common, **pdl.kw(),
        w_desc=_desc(w_gate_up, cfg["GU_BLOCK_N"], bk) if tma else None,
    )
    acts, as_ = quant_valid_rows(act, ends, counts, bm, e_p2) if fp8 else (act, act)
    y = torch.empty(P, H, dtype=x.dtype, device=dev)  # [T*k, H], pair order
    _grouped_down_kernel[(max_blocks, triton.cdiv(H, cfg["DN_BLOCK_N"]))](
        acts, w_down, dn[0], sorted_pairs, ends, counts, y, H, I, E, w_down.stride(0), dn[1], dn[2],
        as_, act.shape[0], BLOCK_N=cfg["DN_BLOCK_N"], **common, **pdl.kw(),
        w_desc=_desc(w_down, cfg["DN_BLOCK_N"], bk) if tma else None,
    )
    return y
