"""Top-k routing steps shared by the kernels that route (`moe._route_kernel`, the routing gate/up
kernel, and the router projection's epilogue in `fp8_linear`): the same instructions in each, so the
same picks wherever the routing runs.

Semantics of `reference.route` / `route_with_shared`: fp32 softmax over the E expert logits, top-k
by repeated max (lowest index on ties), weights renormalised to sum 1; with a shared expert, logit
E gates it as slot k (id E, weight sigmoid(logit E)).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_topk(logits_row, E, n_pick, E_P2: tl.constexpr, K_P2: tl.constexpr, CG: tl.constexpr = 0):
    """fp32 softmax over the E logits at logits_row, then n_pick rounds of max (lowest index on
    ties). -> (probabilities of the picks [K_P2], their experts [K_P2] int32), in pick order.
    CG: load past L1 (logits written by other programs of the same launch)."""
    offs = tl.arange(0, E_P2)
    if CG:
        logit = tl.load(logits_row + offs, mask=offs < E, other=-float("inf"), cache_modifier=".cg")
    else:
        logit = tl.load(logits_row + offs, mask=offs < E, other=-float("inf"))
    logit = logit.to(tl.float32)
    p = tl.exp(logit - tl.max(logit, axis=0))
    p = tl.where(offs < E, p / tl.sum(p, axis=0), -1.0)
    slot = tl.arange(0, K_P2)
    vals = tl.zeros((K_P2,), tl.float32)
    idx = tl.zeros((K_P2,), tl.int32)
    for j in range(0, n_pick):  # one reduction per pick: the max and its (lowest) index together
        top, best = tl.max(p, axis=0, return_indices=True, return_indices_tie_break_left=True)
        vals = tl.where(slot == j, top, vals)
        idx = tl.where(slot == j, best, idx)
        p = tl.where(offs == best, -1.0, p)
    return vals, idx


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
                E_P2: tl.constexpr, K_P2: tl.constexpr, CG: tl.constexpr = 0):
    """One token's routing from its logits row ([E (+1)]) into tw_row / ids_row ([TOP_K + SHARED]):
    renormalised top-k weights and ids; SHARED: slot TOP_K = (sigmoid(logit E), id E)."""
    vals, idx = softmax_topk(logits_row, E, TOP_K, E_P2, K_P2, CG)
    slot = tl.arange(0, K_P2)
    tl.store(tw_row + slot, vals / tl.sum(vals, axis=0), mask=slot < TOP_K)
    tl.store(ids_row + slot, idx.to(tl.int64), mask=slot < TOP_K)
    if SHARED:
        if CG:
            g = tl.load(logits_row + E, cache_modifier=".cg").to(tl.float32)
        else:
            g = tl.load(logits_row + E).to(tl.float32)
        tl.store(tw_row + TOP_K, tl.sigmoid(g))
        tl.store(ids_row + TOP_K, E.to(tl.int64))
