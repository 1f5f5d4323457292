"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds, logit bias.

Random draws are Gumbel-max over counter-based noise: u = hash(seed, step, token id). A request's
draw depends only on its own seed and how many tokens it has produced, not on the batch, the
device or preemption; and there is no generator state to synchronise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash on int64 tensors holding values in [0, 2^32) (no int64 overflow)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """u in (0, 1) of shape [B, vocab] from int64 seeds [B] and steps [B]: 23 bits of the hash plus a
    half, over 2^23, so every value is exact in fp32 and u <= 1 - 2^-24 (a u rounded to 1 would give its
    id an infinite Gumbel score: that id sampled whatever the logits and the filters)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = _mix32(lo ^ _mix32(hi ^ _mix32(steps & _M32)))  # [B]
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _mix32(((idx * 0x9E3779B1) & _M32)[None, :] ^ key[:, None])
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingBatch:
    """Per-row parameters as device tensors, with host flags that skip unused filters."""

    temperature: torch.Tensor  # [B] fp32 (0 = greedy)
    top_k: torch.Tensor  # [B] int64 (0 = off)
    top_p: torch.Tensor  # [B] fp32 (1 = off)
    min_p: torch.Tensor  # [B] fp32 (0 = off)
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64 tokens already generated
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def build(
        cls, rows: list[tuple[float, int, float, float, int, int]], device: torch.device | str
    ) -> SamplingBatch:
        """rows: (temperature, top_k, top_p, min_p, seed, step) per logits row."""
        t, k, p, m, s, st = zip(*rows)
        s = [x - 2**64 if x >= 2**63 else x for x in s]  # keep seeds in int64 range, bits unchanged
        return cls(
            temperature=torch.tensor(t, dtype=torch.float32).to(device),
            top_k=torch.tensor(k, dtype=torch.int64).to(device),
            top_p=torch.tensor(p, dtype=torch.float32).to(device),
            min_p=torch.tensor(m, dtype=torch.float32).to(device),
            seeds=torch.tensor(s, dtype=torch.int64).to(device),
            steps=torch.tensor(st, dtype=torch.int64).to(device),
            all_greedy=all(x == 0.0 for x in t),
            any_top_k=any(x > 0 for x in k),
            any_top_p=any(x < 1.0 for x in p),
            any_min_p=any(x > 0.0 for x in m),
        )


def sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B] int64, without leaving the device."""
    greedy = logits.argmax(dim=-1)
    if sb.all_greedy:
        return greedy
    temp = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
    x = logits / temp[:, None]
    if sb.any_min_p:
        probs = x.softmax(dim=-1)
        thresh = probs.amax(dim=-1, keepdim=True) * sb.min_p[:, None]
        x = x.masked_fill(probs < thresh, float("-inf"))
    if sb.any_top_k or sb.any_top_p:
        x = _top_k_top_p(x, sb)
    u = uniform_noise(sb.seeds, sb.steps, x.shape[-1])
    sampled = (x - torch.log(-torch.log(u))).argmax(dim=-1)
    return torch.where(sb.temperature > 0, sampled, greedy)


def _top_k_top_p(x: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    V = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=x.device)[None, :]
    drop = torch.zeros_like(sorted_x, dtype=torch.bool)
    if sb.any_top_k:
        k = torch.where(sb.top_k > 0, sb.top_k, torch.full_like(sb.top_k, V))
        drop |= rank >= k[:, None]
    if sb.any_top_p:
        probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop |= before >= sb.top_p[:, None]
    drop[:, 0] = False  # the best token always survives
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def top_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-model logprobs: (logprob of `tokens` [B], top-n logprobs [B, n], their ids [B, n])."""
    lp = logits.log_softmax(dim=-1)
    chosen = lp.gather(-1, tokens[:, None])[:, 0]
    if n > 0:
        top_v, top_i = lp.topk(n, dim=-1)
    else:
        top_v = lp.new_empty(lp.shape[0], 0)
        top_i = tokens.new_empty(lp.shape[0], 0)
    return chosen, top_v, top_i


@dataclass(frozen=True)
class LogitBias:
    """One request's sparse additive logit bias, on the host: token ids [n] int64, values [n] fp32."""

    ids: torch.Tensor
    values: torch.Tensor

    @classmethod
    def of(cls, pairs: Iterable[tuple[int, float]]) -> LogitBias:
        pairs = list(pairs)
        return cls(
            ids=torch.tensor([t for t, _ in pairs], dtype=torch.int64),
            values=torch.tensor([v for _, v in pairs], dtype=torch.float32),
        )


def add_logit_bias(logits: torch.Tensor, rows: list[int], biases: list[LogitBias]) -> None:
    """logits [B, V] += biases[k] in row rows[k], in place: one index_put_ on the logits' device from
    index and value tensors staged on the host (pinned on CUDA) and copied without a host wait."""
    pin = logits.device.type == "cuda"
    counts = torch.tensor([b.ids.numel() for b in biases], dtype=torch.int64)
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), counts)
    idx = torch.stack([row_ids, torch.cat([b.ids for b in biases])])  # [2, N]: row, token id
    vals = torch.cat([b.values for b in biases]).to(logits.dtype)  # [N]
    if pin:
        idx, vals = idx.pin_memory(), vals.pin_memory()
    idx = idx.to(logits.device, non_blocking=True)
    vals = vals.to(logits.device, non_blocking=True)
    logits.index_put_((idx[0], idx[1]), vals, accumulate=True)
