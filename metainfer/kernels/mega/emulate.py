"""The megakernel's instructions in PyTorch: what each one computes, with the roundings of the engine's
decode kernels, and the ground truth of mega.cu's GPU tests (instruction by instruction, from the x
the kernel read). Dots run in float64 (the kernel's fp32 sums differ by their rounding only); every
value an instruction stores is rounded to its dtype as the kernel rounds it; side effects (conv and
recurrent states, this step's key and value) are applied to the tensors in place.

`run(instrs, step)` executes a whole program and returns each instruction's outputs; `one(...)`
executes instruction i from given outputs of the earlier ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from metainfer.kernels import reference as ref
from metainfer.kernels.mega import program as P

LOG2E = 1.4426950408889634


def dequant(w: torch.Tensor, ws: torch.Tensor | None) -> torch.Tensor:
    """w [rows, k] e4m3 (times each 128 x 128 block's scale) or bf16 -> float64."""
    wd = w.to(torch.float64)
    if ws is not None:
        s = ws.to(torch.float64).repeat_interleave(128, 0).repeat_interleave(128, 1)
        wd = wd * s[: w.shape[0], : w.shape[1]]
    return wd


def _bf(x: torch.Tensor) -> torch.Tensor:
    """Rounded to bf16, back in fp32."""
    return x.to(torch.bfloat16).float()


def x_values(x: P.X, vals: list[torch.Tensor], n: int, step: torch.Tensor) -> torch.Tensor:
    """The n values x names, in their stored dtype."""
    if isinstance(x, P.Src):
        return vals[x.index][x.off : x.off + n]
    if isinstance(x, P.Vec):
        return x.t
    return x.table[int(step[P.STEP_TOKEN])]


def residual(x: P.X, add: P.Src | None, vals, n: int, step) -> torch.Tensor:
    """bf16(x + add) (the residual stream after an add), or x alone; bf16 [n]."""
    h = x_values(x, vals, n, step)
    return h if add is None else (h.float() + x_values(add, vals, n, step).float()).to(torch.bfloat16)


def route(logits: torch.Tensor, top_k: int) -> tuple[list[int], torch.Tensor]:
    """Logits [E + 1] bf16 -> (the top_k experts, then the shared one (id E); their weights fp32): the
    routed weights renormalised over the picks of an fp32 softmax (ties: the lower index), the shared
    one sigmoid(logit E)."""
    E = logits.numel() - 1
    lf = logits.float()
    num = torch.exp(lf[:E] - lf[:E].max())
    prob = num / num.sum()
    order = sorted(range(E), key=lambda e: (-float(num[e]), e))[:top_k]
    w = prob[order]
    w = w / w.sum()
    return [*order, E], torch.cat([w, torch.sigmoid(lf[E:])])


def _norm_rope(x: torch.Tensor, w: torch.Tensor, eps: float, pos: int, inv_freq: torch.Tensor
               ) -> torch.Tensor:
    """qk_norm_rope's math on one head [D]: RMSNorm (1 + w), NeoX RoPE on the first 2 * len(inv_freq)
    dims, in fp32 (rounded by the caller)."""
    xf = x.float()
    D, half = xf.numel(), inv_freq.numel()
    xn = xf * torch.rsqrt(xf.pow(2).sum() / D + eps) * (1.0 + w.float())
    freq = pos * inv_freq.float()
    cos, sin = torch.cos(freq), torch.sin(freq)
    x1, x2 = xn[:half], xn[half : 2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xn[2 * half :]])


def gemv(g: P.Gemv, vals, step) -> torch.Tensor:
    k = g.k
    if g.gated:
        core = x_values(g.x, vals, k, step).view(-1, g.head_dim)
        z = x_values(g.add, vals, k, step).view(-1, g.head_dim)
        xf = ref.gated_rms_norm(core, z, g.norm_w, g.eps).reshape(-1).float()
    elif g.norm_w is not None:
        xf = ref.rms_norm(residual(g.x, g.add, vals, k, step), g.norm_w, g.eps).float()
    else:
        xf = x_values(g.x, vals, k, step).float()
    y = (dequant(g.w, g.ws) @ xf.double()).float()  # [rows]
    if g.conv_w is not None:  # the DeltaNet decode conv on the first C rows (ref.causal_conv1d_update)
        C = g.conv_w.shape[0]
        slot, has = int(step[P.STEP_STATE_SLOT]), bool(step[P.STEP_HAS_STATE])
        prev = g.conv_state[slot].float() * float(has)  # [K - 1, C]
        yb = _bf(y[:C])
        window = torch.cat([prev, yb[None]], dim=0)  # [K, C]
        c = (window * g.conv_w.float().t()).sum(0)
        g.conv_state[slot] = window[1:].to(g.conv_state.dtype)
        out = _bf(y)
        out[:C] = _bf(F.silu(_bf(c)))
        y = out
    if g.out == P.OUT_BF16:
        return y.to(torch.bfloat16)
    if g.out == P.OUT_PLAIN_F32:
        g.plain_out.copy_(y)
    return y


def gate_up(g: P.GateUp, vals, step) -> torch.Tensor:
    E1, I2, H = g.w.shape
    xn = ref.rms_norm(residual(g.x, g.add, vals, H, step), g.norm_w, g.eps).double()
    ids, _ = route(vals[g.logits.index], g.top_k)
    acts = []
    for e in ids:
        gu = (dequant(g.w[e], g.ws[e]) @ xn).float()
        gate, up = gu[: I2 // 2], gu[I2 // 2 :]
        acts.append((F.silu(gate) * up).to(torch.bfloat16))
    return torch.cat(acts)


def down(g: P.Down, vals, step) -> torch.Tensor:
    E1, H, I = g.w.shape
    ids, wts = route(vals[g.logits.index], g.top_k)
    act = x_values(g.act, vals, len(ids) * I, step).double()
    acc = torch.zeros(H, dtype=torch.float32, device=g.w.device)
    for j, e in enumerate(ids):
        y = (dequant(g.w[e], g.ws[e]) @ act[j * I : (j + 1) * I]).float()
        acc = acc + wts[j] * y  # fp32, slot order
    r = residual(g.res, g.res_add, vals, H, step)
    return (_bf(acc) + r.float()).to(torch.bfloat16)


def delta_state(g: P.DeltaState, vals, step) -> torch.Tensor:
    S_, Hv, Dk, Dv = g.state.shape
    proj = vals[g.proj.index].float()
    hk = g.hk
    q = proj[: hk * Dk].view(hk, Dk)
    k = proj[hk * Dk : 2 * hk * Dk].view(hk, Dk)
    v = proj[2 * hk * Dk : 2 * hk * Dk + Hv * Dv].view(Hv, Dv)
    b, a = proj[g.b_off : g.b_off + Hv], proj[g.a_off : g.a_off + Hv]
    slot, has = int(step[P.STEP_STATE_SLOT]), bool(step[P.STEP_HAS_STATE])
    out = torch.empty(Hv, Dv, dtype=torch.bfloat16, device=g.state.device)
    for h in range(Hv):
        kh = h // (Hv // hk)
        qn = q[kh] * torch.rsqrt(q[kh].pow(2).sum() + 1e-6) * Dk**-0.5
        kn = k[kh] * torch.rsqrt(k[kh].pow(2).sum() + 1e-6)
        ah = a[h] + g.dt_bias[h].float()
        softplus = ah if ah > 20.0 else torch.log1p(torch.exp(ah))
        decay = torch.exp(-torch.exp(g.A_log[h].float()) * softplus)
        beta = _bf(torch.sigmoid(b[h]))
        S = g.state[slot, h].clone() if has else torch.zeros_like(g.state[slot, h])
        S = S * decay
        kv = (S * kn[:, None]).sum(0)
        delta = (v[h] - kv) * beta
        S = S + kn[:, None] * delta[None, :]
        out[h] = (S * qn[:, None]).sum(0).to(torch.bfloat16)
        g.state[slot, h] = S
    return out.view(-1)


def attend(g: P.Attend, vals, step) -> torch.Tensor:
    hq, hkv, D, ns = g.hq, g.hkv, g.d, g.splits
    qkv = vals[g.qkv.index][g.qkv.off :]
    pos, kv_slot, L = int(step[P.STEP_POS]), int(step[P.STEP_KV_SLOT]), int(step[P.STEP_SEQ_LEN])
    ks, vs = qkv[2 * hq * D :].view(2, hkv, D)
    kc, vc = g.k_cache.view(-1, hkv, D), g.v_cache.view(-1, hkv, D)
    for h in range(hkv):  # this step's key (normed, rotated) and value into the cache
        kc[kv_slot, h] = _norm_rope(ks[h], g.k_norm_w, g.eps, pos, g.inv_freq).to(torch.bfloat16)
        vc[kv_slot, h] = vs[h]
    bs = g.k_cache.shape[1]
    p_ = torch.arange(L, device=g.block_table.device)
    rows = g.block_table[p_ // bs].long() * bs + p_ % bs
    per = -(-L // ns)
    out = torch.zeros(hq, ns, D + 2, device=g.k_cache.device)
    for h in range(hq):
        q = _bf(_norm_rope(qkv[h * 2 * D : h * 2 * D + D], g.q_norm_w, g.eps, pos, g.inv_freq))
        kvh = h // (hq // hkv)
        for s in range(ns):
            lo, hi = s * per, min((s + 1) * per, L)
            if lo >= hi:
                out[h, s, D] = -math.inf
                continue
            kk, vv = kc[rows[lo:hi], kvh].float(), vc[rows[lo:hi], kvh].float()
            sc = (kk.double() @ q.double()).float() * (D**-0.5 * LOG2E)
            m = sc.max()
            pr = torch.exp2(sc - m)
            lsum = pr.sum()
            o = (_bf(pr).double() @ vv.double()).float() / lsum
            out[h, s, :D] = o
            out[h, s, D] = m + torch.log2(lsum)
            out[h, s, D + 1] = lsum
    return out.view(-1)


def combine(g: P.Combine, vals, step) -> torch.Tensor:
    hq, D, ns = g.hq, g.d, g.splits
    parts = vals[g.parts.index][g.parts.off :].view(hq, ns, D + 2)
    qkv = vals[g.qkv.index][g.qkv.off :]
    out = torch.empty(hq, D, dtype=torch.bfloat16, device=qkv.device)
    for h in range(hq):
        lse = parts[h, :, D]
        m = lse.max()
        m = torch.zeros_like(m) if m == -math.inf else m
        w = torch.where(lse > -math.inf, torch.exp2(lse - m), torch.zeros_like(lse))
        o = (w[:, None] * parts[h, :, :D]).sum(0) / w.sum()
        gate = qkv[h * 2 * D + D : (h + 1) * 2 * D].float()
        out[h] = (_bf(o) * _bf(torch.sigmoid(gate))).to(torch.bfloat16)
    return out.view(-1)


_OPS = {P.Gemv: gemv, P.GateUp: gate_up, P.Down: down, P.DeltaState: delta_state, P.Attend: attend,
        P.Combine: combine}


def one(g: P.Instr, vals: list[torch.Tensor], step: torch.Tensor) -> torch.Tensor:
    """Instruction g's outputs (bf16 or fp32 [rows]) from the earlier instructions' outputs `vals`;
    its side effects applied."""
    return _OPS[type(g)](g, vals, step)


def run(instrs: list[P.Instr], step: torch.Tensor) -> list[torch.Tensor]:
    """Every instruction in order (P.check first): -> each one's outputs."""
    P.check(instrs)
    step = step.cpu()
    vals: list[torch.Tensor] = []
    for g in instrs:
        vals.append(one(g, vals, step))
    return vals
