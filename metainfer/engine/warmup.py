"""Start-up warmup: eager steps shaped like a busy server's, run before the first request so that
Triton's JIT compiles (one per kernel and argument specialisation: integers are specialised on
== 1 and % 16) happen here rather than inside the first busy step's TTFT.

The steps run on the null state slot and KV block 0: whatever they write there is never read, as
with the CUDA graphs' padding rows.
"""

from __future__ import annotations

import time

import torch

from metainfer.config import EngineConfig
from metainfer.forward_meta import CacheTensors, ForwardMeta
from metainfer.model.qwen3_5_moe import Qwen3_5MoeModel

Step = tuple[list[int], list[int]]  # (query lens, context lens), decodes first


def warmup_steps(e: EngineConfig) -> list[Step]:
    """Steps covering what serving meets beyond the graphs: the full step budget over one, three and
    four prompts with 1, 2, 4, 12 or 28 decodes beside them (1: a burst whose first prompt came a step
    early; sequence counts of 16 and 32 included) and with or without a prompt's later chunk (context
    > 0); 1 / 15 / 16 decodes beside a prompt; token totals across the grouped-MoE tile buckets, odd
    and even. The shapes of a burst of 1k prompts were checked against the scheduler's
    (tests/engine/test_warmup.py)."""
    budget = min(e.max_num_batched_tokens, e.max_model_len * e.max_num_seqs)
    steps: list[Step] = []
    for total in sorted({budget, budget - 3, 2048, 2047, 1024, 1023, 700, 301, 64, 17}):
        if total < 8 or total > budget:
            continue
        least = -(-total // e.max_model_len)  # prompts of <= max_model_len tokens
        # one prompt, three of odd lengths, and four of lengths divisible by 16 (a busy server's
        # 1k prompts: 4 x 1,024 in a 4,096-token step; a kernel's variant keys on every argument)
        splits = {least, max(least, 3)} | ({max(least, 4)} if total % 64 == 0 else set())
        full = total >= budget - 3  # a busy server's full steps: more decode counts beside them
        for k in sorted(splits):
            if k > e.max_num_seqs:
                continue
            lens = [total // k] * k
            lens[-1] += total - sum(lens)
            steps.append((lens, [0] * k))  # prompts only
            for d, later in ((1, 0), (2, 0), (2, 1), (4, 0), (12, 1), (28, 0)) if full else ((2, 1),):
                if k + d <= e.max_num_seqs and lens[-1] > d:
                    chunk = lens[-1] - d
                    ctx = min(40, e.max_model_len - chunk) if later else 0  # a prompt's later chunk
                    ctxs = list(range(17, 17 + d)) + [0] * (k - 1) + [ctx]
                    steps.append(([1] * d + lens[:-1] + [chunk], ctxs))
    for d in (1, 15, 16):
        if d + 1 <= e.max_num_seqs and d + 100 <= budget:
            steps.append(([1] * d + [100], list(range(20, 20 + d)) + [0]))
    return [(q, c) for q, c in steps if all(a + b <= e.max_model_len for a, b in zip(q, c))]


@torch.inference_mode()
def run_warmup(
    model: Qwen3_5MoeModel,
    caches: CacheTensors,
    steps: list[Step],
    block_size: int,
    max_blocks: int,
    device: torch.device,
) -> float:
    """Runs `steps` eagerly (forward, logits of each sequence's last token, argmax). -> seconds."""
    t0 = time.perf_counter()
    for qlens, ctx in steps:
        k = len(qlens)
        meta = ForwardMeta.build(
            query_lens=qlens,
            context_lens=ctx,
            block_tables=[[0] * -(-(c + q) // block_size) for q, c in zip(qlens, ctx)],
            state_slots=[0] * k,
            block_size=block_size,
            logits_rows=[sum(qlens[: i + 1]) - 1 for i in range(k)],
            device=device,
            max_blocks=max_blocks,
        )
        ids = torch.zeros(sum(qlens), dtype=torch.int64, device=device)
        pos = torch.cat([torch.arange(c, c + q) for q, c in zip(qlens, ctx)]).to(device)
        hidden = model(ids, pos, meta, caches)
        model.compute_logits(hidden[meta.logits_indices]).argmax(dim=-1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
