"""Routing: the top-k steps shared by every kernel that routes (`_route_kernel` here, the routing
gate/up and down kernels in `moe`, the router projection's epilogue in `weight_stream`: the same
instructions in each, so the same picks wherever the routing runs), `route_topk` (one launch), and
`combine`, the weighted sum of each token's expert rows.

Semantics of `reference.route` / `route_with_shared`: fp32 softmax over the E expert logits, top-k
by repeated max (lowest index on ties), weights renormalised to sum 1; with a shared expert, logit
E gates it as slot k (id E, weight sigmoid(logit E)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metainfer.kernels import pdl


@triton.jit
def softmax_topk(logits_row, E, n_pick, E_P2: tl.constexpr, K_P2: tl.constexpr):
    """fp32 softmax over the E logits at logits_row, then n_pick rounds of max (lowest index on
    ties). -> (probabilities of the picks [K_P2], their experts [K_P2] int32), in pick order.

    The rounds run on the logits themselves, not the probabilities: exp is monotonic, so the picks
    are the probabilities' except where exp or the division by the sum rounds two different logits
    to one probability (the larger logit is picked first here, the lower index there). They need no
    exp and no sum, so they depend on no reduction order (a kernel's warp count) and no exp
    implementation: cuda/gemv.cu's routing (`route_topk`) ranks the same logits the same way, so
    its picks and this kernel's agree bit for bit."""
    offs = tl.arange(0, E_P2)
    logit = tl.load(logits_row + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    mx = tl.max(logit, axis=0)
    num = tl.exp(logit - mx)
    e = logit + 0.0  # -0.0 as +0.0 (equal anyway under ==: the tie rule sees them as one value)
    slot = tl.arange(0, K_P2)
    vals = tl.full((K_P2,), -float("inf"), tl.float32)  # (slots past n_pick: probability 0)
    idx = tl.zeros((K_P2,), tl.int32)
    for j in range(0, n_pick):  # one reduction per pick: the max and its (lowest) index together
        top, best = tl.max(e, axis=0, return_indices=True, return_indices_tie_break_left=True)
        vals = tl.where(slot == j, top, vals)
        idx = tl.where(slot == j, best, idx)
        e = tl.where(offs == best, -float("inf"), e)
    return tl.exp(vals - mx) / tl.sum(num, axis=0), idx


@triton.jit
def slot_pick(logits_row, E, j, ROUTE_K: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr):
    """The expert of slot j of a token (logits at logits_row): slot j < ROUTE_K is the token's
    (j+1)-th pick (j + 1 rounds of `softmax_topk`), slot ROUTE_K the shared expert, id E.
    -> (expert int64, the picks' probabilities [K_P2], their experts [K_P2])."""
    routed = j < ROUTE_K
    vals, idx = softmax_topk(logits_row, E, tl.where(routed, j + 1, 0), E_P2, K_P2)
    slot = tl.arange(0, K_P2)
    e = tl.where(routed, tl.sum(tl.where(slot == j, idx, 0), axis=0), E).to(tl.int64)
    return e, vals, idx


@triton.jit
def route_token(logits_row, E, tw_row, ids_row, TOP_K: tl.constexpr, SHARED: tl.constexpr,
                E_P2: tl.constexpr, K_P2: tl.constexpr):
    """One token's routing from its logits row ([E (+1)]) into tw_row / ids_row ([TOP_K + SHARED]):
    renormalised top-k weights and ids; SHARED: slot TOP_K = (sigmoid(logit E), id E)."""
    vals, idx = softmax_topk(logits_row, E, TOP_K, E_P2, K_P2)
    slot = tl.arange(0, K_P2)
    tl.store(tw_row + slot, vals / tl.sum(vals, axis=0), mask=slot < TOP_K)
    tl.store(ids_row + slot, idx.to(tl.int64), mask=slot < TOP_K)
    if SHARED:
        g = tl.load(logits_row + E).to(tl.float32)
        tl.store(tw_row + TOP_K, tl.sigmoid(g))
        tl.store(ids_row + TOP_K, E.to(tl.int64))


@triton.jit
def _combine_kernel(y_ptr, tw_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                    USE_PDL: tl.constexpr = 0):
    pdl.wait(USE_PDL)
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in range(TOP_K):
        y = tl.load(y_ptr + (t * TOP_K + j) * H + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        acc += tl.load(tw_ptr + t * TOP_K + j) * y
    tl.store(out_ptr + t * H + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_lt, TOP_K: tl.constexpr, E_P2: tl.constexpr,
                  K_P2: tl.constexpr, SHARED: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """One token: fp32 softmax over E logits, top-k by repeated argmax (lowest index on ties),
    weights renormalised to sum 1. SHARED: logit E gates the shared expert, stored as slot TOP_K
    (id E, weight sigmoid(logit E))."""
    pdl.wait(USE_PDL)
    t = tl.program_id(0)
    W: tl.constexpr = TOP_K + SHARED
    route_token(logits_ptr + t * stride_lt, E, w_ptr + t * W, ids_ptr + t * W, TOP_K, SHARED, E_P2, K_P2)


# ---- launchers -----------------------------------------------------------------------------------
def route_topk(
    router_logits: torch.Tensor, top_k: int, shared: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.route` in one launch: logits [T, E] (rows may be strided) -> (weights [T, k] fp32,
    ids [T, k] int64). shared: logits are [T, E+1] and a slot k (id E, weight sigmoid(logit E))
    is appended for the shared expert, as in `reference.route_with_shared`."""
    T, E = router_logits.shape
    E -= int(shared)
    assert router_logits.stride(1) == 1 and 0 < top_k <= E, (router_logits.stride(), top_k)
    w = torch.empty(T, top_k + int(shared), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k + int(shared), dtype=torch.int64, device=router_logits.device)
    if T:
        _route_kernel[(T,)](router_logits, w, ids, E, router_logits.stride(0), TOP_K=top_k,
                            E_P2=triton.next_power_of_2(E), K_P2=triton.next_power_of_2(top_k),
                            SHARED=int(shared), **pdl.kw())
    return w, ids


def combine(y: torch.Tensor, tw: torch.Tensor, out: torch.Tensor) -> None:
    """out[t] = sum_j tw[t, j] * y[t * k + j] in slot order: y [T*k, H] (any float dtype), tw [T, k]
    fp32, out [T, H]."""
    T, k = tw.shape
    H = y.shape[1]
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block_h))](y, tw, out, H, TOP_K=k, BLOCK_H=block_h, **pdl.kw())
