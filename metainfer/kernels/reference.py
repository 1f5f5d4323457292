"""Plain-PyTorch references for every op the model runs.

These are the CPU path and the ground truth each Triton kernel is tested against. They follow the
numerics of transformers' `Qwen3_5Moe` (fp32 norms and recurrences, model-dtype projections).
Shapes use T = tokens in the step, B = sequences, S = cache state slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# ---- norms ---------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5 RMSNorm: x / rms(x) * (1 + w), computed in fp32, returned in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (x alone when None); returns (rms_norm(residual'), residual')."""
    r = x if residual is None else x + residual
    return rms_norm(r, weight, eps), r


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeltaNet output norm over the last dim: (w * x / rms(x)) * silu(z); plain w (no 1+)."""
    dt = x.dtype
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    h = weight * h
    return (h * F.silu(z.float())).to(dt)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """DeltaNet gates from the raw projections a, b [T, Hv]: (g = -exp(A_log) softplus(a + dt_bias)
    [T, Hv] fp32 log decay, beta = sigmoid(b) in b's dtype)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ---- rotary --------------------------------------------------------------------------------------
def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first 2*len(inv_freq) dims of x [T, H, D] at positions [T]."""
    rd = inv_freq.numel() * 2
    freqs = positions.float()[:, None] * inv_freq.to(x.device)[None, :]  # [T, rd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, :]
    sin = emb.sin().to(x.dtype)[:, None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
    rot = torch.cat((-x2, x1), dim=-1)
    return torch.cat((xr * cos + rot * sin, xp), dim=-1)


# ---- causal conv1d with state --------------------------------------------------------------------
def causal_conv1d(
    x: torch.Tensor,  # [T, C] this step's inputs, sequences concatenated
    conv_state: torch.Tensor,  # [S, K-1, C] the last K-1 inputs of each slot (updated in place)
    weight: torch.Tensor,  # [C, K]
    query_start_loc: list[int],  # [B+1] host offsets of each sequence in x
    slots: list[int],  # [B]
    has_state: list[bool],  # [B] False: the sequence starts here, its state is taken as zeros
) -> torch.Tensor:
    """Depthwise causal conv over each sequence, continuing from its state, then SiLU. An empty
    sequence leaves its state as it is."""
    K = weight.shape[1]
    out = torch.empty_like(x)
    for b, slot in enumerate(slots):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        if e == s:
            continue
        prev = conv_state[slot] if has_state[b] else torch.zeros_like(conv_state[slot])
        seq = torch.cat([prev.to(x.dtype), x[s:e]], dim=0)  # [K-1+L, C]
        y = F.conv1d(seq.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])
        out[s:e] = F.silu(y[0].t()).to(x.dtype)
        conv_state[slot] = seq[-(K - 1) :].to(conv_state.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,  # [B, C] one new input per sequence
    conv_state: torch.Tensor,  # [S, K-1, C]
    weight: torch.Tensor,  # [C, K]
    slots: torch.Tensor,  # [B] int64
    has_state: torch.Tensor,  # [B] bool
) -> torch.Tensor:
    """Batched single-token step of `causal_conv1d`; returns silu(conv) [B, C]."""
    prev = conv_state[slots] * has_state[:, None, None].to(conv_state.dtype)  # [B, K-1, C]
    window = torch.cat([prev.to(x.dtype), x[:, None, :]], dim=1)  # [B, K, C]
    y = (window.to(weight.dtype) * weight.t()[None]).sum(dim=1)
    conv_state[slots] = window[:, 1:].to(conv_state.dtype)
    return F.silu(y).to(x.dtype)


# ---- gated delta rule ----------------------------------------------------------------------------
def _prep_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise q, k in fp32, scale q by Dk^-0.5, and expand key heads to the value heads."""
    rep = num_v_heads // q.shape[-2]
    q = l2norm(q.float()) * (q.shape[-1] ** -0.5)
    k = l2norm(k.float())
    if rep > 1:
        q = q.repeat_interleave(rep, dim=-2)
        k = k.repeat_interleave(rep, dim=-2)
    return q, k


def gated_delta_rule_recurrent(
    q: torch.Tensor,  # [B, L, Hk, Dk]
    k: torch.Tensor,  # [B, L, Hk, Dk]
    v: torch.Tensor,  # [B, L, Hv, Dv]
    g: torch.Tensor,  # [B, L, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [B, L, Hv]
    state: torch.Tensor,  # [B, Hv, Dk, Dv] fp32 initial state
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule. Returns (out [B, L, Hv, Dv] in v's dtype, final state fp32)."""
    qf, kf = _prep_qk(q, k, v.shape[-2])
    vf, gf, bf = v.float(), g.float(), beta.float()
    S = state.float().clone()
    outs = []
    for t in range(v.shape[1]):
        S = S * gf[:, t].exp()[..., None, None]
        kv_mem = (S * kf[:, t, :, :, None]).sum(dim=-2)  # [B, Hv, Dv]
        delta = (vf[:, t] - kv_mem) * bf[:, t, :, None]
        S = S + kf[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((S * qf[:, t, :, :, None]).sum(dim=-2))
    return torch.stack(outs, dim=1).to(v.dtype), S


def gated_delta_rule_chunked(
    q: torch.Tensor,  # [L, Hk, Dk] one sequence
    k: torch.Tensor,  # [L, Hk, Dk]
    v: torch.Tensor,  # [L, Hv, Dv]
    g: torch.Tensor,  # [L, Hv]
    beta: torch.Tensor,  # [L, Hv]
    state: torch.Tensor,  # [Hv, Dk, Dv] fp32 initial state
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY) form of the same recurrence, for prefill.

    Within a chunk with cumulative log decay c_i and start state S0, the per-token updates
    u = beta * (v - k^T S_before) satisfy (I + A) U = diag(beta) V - diag(beta e^c) K S0 with
    A[i, j] = beta_i e^(c_i - c_j) k_i.k_j (j < i). Then O = (Q e^c) S0 + (QK^T o D) U with D the
    causal decay mask, and the end state is e^(c_C) S0 + (K e^(c_C - c))^T U.
    """
    L, Hv, Dv = v.shape
    qf, kf = _prep_qk(q, k, Hv)
    vf, gf, bf = v.float(), g.float(), beta.float()
    pad = (-L) % chunk
    if pad:  # zero k, v, beta and g: padded tokens neither decay nor write the state
        qf, kf, vf = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (qf, kf, vf))
        gf, bf = (F.pad(t, (0, 0, 0, pad)) for t in (gf, bf))
    n = (L + pad) // chunk
    # -> [Hv, n, C, D]
    qc, kc, vc = (t.reshape(n, chunk, Hv, -1).permute(2, 0, 1, 3) for t in (qf, kf, vf))
    gc, bc = (t.reshape(n, chunk, Hv).permute(2, 0, 1) for t in (gf, bf))
    c = gc.cumsum(-1)  # [Hv, n, C]
    diff = c[..., :, None] - c[..., None, :]  # c_i - c_j
    lower_incl = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = diff.masked_fill(~lower_incl, float("-inf")).exp()  # [Hv, n, C, C], 0 above diagonal
    kk = kc @ kc.transpose(-1, -2)
    A = (bc[..., :, None] * kk * decay).tril(-1)
    eye = torch.eye(chunk, dtype=A.dtype, device=A.device)
    rhs_v = bc[..., None] * vc  # diag(beta) V
    rhs_k = (bc * c.exp())[..., None] * kc  # diag(beta e^c) K
    new_v = torch.linalg.solve_triangular(eye + A, rhs_v, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(eye + A, rhs_k, upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay  # [Hv, n, C, C]
    q_dec = qc * c.exp()[..., None]
    k_dec = kc * (c[..., -1:] - c).exp()[..., None]
    chunk_decay = c[..., -1].exp()  # [Hv, n]
    S = state.float().clone()
    out = torch.empty_like(vc)
    for i in range(n):
        u = new_v[:, i] - k_cum[:, i] @ S  # [Hv, C, Dv]
        out[:, i] = q_dec[:, i] @ S + attn[:, i] @ u
        S = S * chunk_decay[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ u
    out = out.permute(1, 2, 0, 3).reshape(n * chunk, Hv, Dv)[:L]
    return out.to(v.dtype), S


# ---- attention over the paged KV cache -----------------------------------------------------------
def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached entries of one sequence: cache [N, bs, Hkv, D] -> [length, Hkv, D]."""
    bs = cache.shape[1]
    nb = (length + bs - 1) // bs
    return cache[block_table[:nb].long()].reshape(nb * bs, *cache.shape[2:])[:length]


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D] (normed, rotated)
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] already holding this step's keys
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: list[int],  # [B+1]
    seq_lens: list[int],  # [B] cached + new tokens
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached sequence. -> [T, Hq, D]."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k_cache.shape[2]
    for b in range(len(seq_lens)):
        s, e, n = query_start_loc[b], query_start_loc[b + 1], seq_lens[b]
        kb = gather_kv(k_cache, block_tables[b], n).repeat_interleave(rep, dim=1)  # [n, Hq, D]
        vb = gather_kv(v_cache, block_tables[b], n).repeat_interleave(rep, dim=1)
        qb = q[s:e]
        scores = torch.einsum("qhd,khd->hqk", qb, kb).float() * scale  # [Hq, Lq, n]
        qpos = torch.arange(n - (e - s), n, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] > qpos[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        p = scores.softmax(-1).to(q.dtype)
        out[s:e] = torch.einsum("hqk,khd->qhd", p, vb)
    return out


# ---- MoE -----------------------------------------------------------------------------------------
def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax over experts, top-k, renormalised. -> (weights [T, k] fp32, ids [T, k] int64)."""
    probs = router_logits.float().softmax(dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    return w / w.sum(dim=-1, keepdim=True), ids


def route_with_shared(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E+1]: top-k routing over the first E, plus slot k = the shared expert (id E) with
    weight sigmoid(logit E). -> (weights [T, k+1] fp32, ids [T, k+1] int64)."""
    E = router_logits.shape[1] - 1
    w, ids = route(router_logits[:, :E], top_k)
    gate = torch.sigmoid(router_logits[:, E:].float())
    return torch.cat([w, gate], dim=1), torch.cat([ids, torch.full_like(ids[:, :1], E)], dim=1)


def moe_experts(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) over each token's selected experts. -> [T, H]."""
    out = torch.zeros_like(x)
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w_gate_up.shape[0]).tolist()
    tok = order // topk_ids.shape[1]
    wts = topk_weights.flatten()[order].to(x.dtype)
    start = 0
    for e, cnt in enumerate(counts):
        if cnt == 0:
            continue
        idx = tok[start : start + cnt]
        h = F.linear(x[idx], w_gate_up[e])
        gate, up = h.chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e]) * wts[start : start + cnt, None]
        out.index_add_(0, idx, y)
        start += cnt
    return out


def moe_expert_rows(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    ids: torch.Tensor,  # [T, W]
) -> torch.Tensor:
    """Each (token, slot)'s expert output, unweighted: down_e(silu(gate_e x) * up_e x), the
    activation in x's dtype, the output fp32. -> [T, W, H]."""
    T, W = ids.shape
    out = torch.empty(T, W, x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(T):
        for j in range(W):
            e = int(ids[t, j])
            gate, up = (w_gate_up[e].float() @ x[t].float()).chunk(2)
            act = (F.silu(gate) * up).to(x.dtype)
            out[t, j] = w_down[e].float() @ act.float()
    return out


def moe_combine(rows: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [T, W, H] fp32, weights [T, W] -> sum_j weights[:, j] * rows[:, j] (fp32, slot order),
    rounded to dtype. -> [T, H]."""
    acc = torch.zeros(rows.shape[0], rows.shape[2], dtype=torch.float32, device=rows.device)
    for j in range(rows.shape[1]):
        acc += weights[:, j, None].float() * rows[:, j]
    return acc.to(dtype)


def decode_inputs(packed: torch.Tensor, tok_buf: torch.Tensor, n: int, context_lens: torch.Tensor,
                  seq_lens: torch.Tensor) -> None:
    """A decode step's packed rows made the model's inputs, in place (kernels.decode_io's contract):
    packed [7, >= n] int64 (ids, positions, kv slot, state slot, context len, seq len, pending
    source); ids[i] = tok_buf[source[i]] where source[i] >= 0; the lengths into int32 buffers."""
    src = packed[6, :n]
    pending = src >= 0
    packed[0, :n] = torch.where(pending, tok_buf[src.clamp(min=0)], packed[0, :n])
    context_lens[:n].copy_(packed[4, :n])
    seq_lens[:n].copy_(packed[5, :n])


def argmax_rows(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[:R] = the greedy token of each row of x [R, V] (torch.argmax: lowest index on ties)."""
    out[: x.shape[0]].copy_(x.argmax(dim=-1))
    return out
