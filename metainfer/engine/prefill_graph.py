"""CUDA graphs for a lone prefill: one request's prompt (or its last chunk) alone in a step, the
idle server's TTFT case. An eager 1k-token prefill makes ~1,100 launches whose host time exceeds
their ~30 ms of GPU time (benchmarks/results/2026-11-30f, "TTFT"); a replay is one launch.

A captured step of `size` tokens holds two sequences: 0 is the request's chunk of n <= size tokens,
1 pads the step to `size` tokens (possibly none) as a fresh sequence on the null state slot 0 and
the null KV block 0 (like the decode graphs' padding rows: whatever it writes there is never read). The
kernels take every length from the device offsets; the host gives only `size`, the grids' bound
(`ForwardMeta.max_query_len`). One graph per size, captured largest first into one pool; the
logits of the chunk's last `logits_rows` tokens come out of the graph (more than one: a speculative
verify, the last real token and its drafts), sampling runs after the replay.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from metainfer.engine.cuda_graph import capture_graphs
from metainfer.model.meta import CacheTensors, ForwardMeta
from metainfer.model.qwen3_5_moe import Qwen3_5MoeModel


class PrefillGraphs:
    def __init__(
        self,
        model: Qwen3_5MoeModel,
        caches: CacheTensors,
        sizes: Sequence[int],
        max_blocks: int,
        block_size: int,
        device: torch.device,
        use_graphs: bool = True,
        logits_rows: int = 1,
    ) -> None:
        assert sizes and all(s >= 1 for s in sizes) and logits_rows >= 1, (sizes, logits_rows)
        # the padding sequence (up to size - 1 tokens) reads its row of `max_blocks` null blocks
        assert max(sizes) <= max_blocks * block_size, (sizes, max_blocks, block_size)
        self.model, self.caches, self.device = model, caches, device
        self.sizes = sorted(set(sizes))
        self.block_size = block_size
        self.use_graphs = use_graphs and device.type == "cuda"
        S, i32, i64 = self.sizes[-1], torch.int32, torch.int64
        z = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self._tok = z(3, S, dtype=i64)  # input ids, positions, KV slot of each token
        self.input_ids, self.positions, self.slot_mapping = self._tok
        self._seq = z(7, dtype=i32)  # query_start_loc [3] | seq_lens [2] | context_lens [2]
        self.query_start_loc, self.seq_lens, self.context_lens = self._seq[:3], self._seq[3:5], self._seq[5:7]
        self.block_tables = z(2, max_blocks, dtype=i32)  # row 1: the padding sequence, all null blocks
        self.state_slots = z(2, dtype=i64)
        self.logits_indices = z(logits_rows, dtype=i64)  # the chunk's last rows (the last repeated)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.runs = 0  # steps served (replays, or eager runs of the layout without graphs)

    @property
    def max_tokens(self) -> int:
        """The longest chunk served."""
        return self.sizes[-1]

    def size_for(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]  # the smallest size >= n

    def _meta(self, size: int, host: tuple[int, int, int] | None = None) -> ForwardMeta:
        """Metadata over the buffers for a step of `size` tokens. `host` = (n, start, state slot):
        exact host copies for the eager path (the reference ops read them); captured kernels read
        only the device tensors and `size`."""
        n, start, slot = host or (size, 0, 0)
        return ForwardMeta(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            context_lens=self.context_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping[:size],
            state_slots=self.state_slots,
            logits_indices=self.logits_indices,
            query_start_loc_cpu=[0, n, size],
            seq_lens_cpu=[start + n, size - n],
            context_lens_cpu=[start, 0],
            state_slots_cpu=[slot, 0],
            num_decodes=0,
            num_decode_tokens=0,
            max_query_len=size,
        )

    def _forward(self, size: int, host: tuple[int, int, int] | None = None) -> torch.Tensor:
        meta = self._meta(size, host)
        hidden = self.model(self.input_ids[:size], self.positions[:size], meta, self.caches)
        return self.model.compute_logits(hidden[meta.logits_indices])  # [logits_rows, V] fp32

    def _fill(
        self, size: int, tokens: list[int], start: int, block_ids: list[int], slot: int, rows: int = 1
    ) -> None:
        """Stages the chunk tokens[0:n] at positions start.. of a request (its KV blocks, its state
        slot) and the padding sequence behind it; logits for its last `rows` tokens."""
        n, bs, pad = len(tokens), self.block_size, size - len(tokens)
        assert 0 < n <= size and len(block_ids) * bs >= start + n, (n, size, start, len(block_ids))
        pos = list(range(start, start + n))
        kv = [block_ids[p // bs] * bs + p % bs for p in pos] + [p % bs for p in range(pad)]  # pad: block 0
        tok = torch.tensor([tokens + [0] * pad, pos + list(range(pad)), kv], dtype=torch.int64)
        self._tok[:, :size].copy_(tok.to(self.device, non_blocking=True))
        seq = torch.tensor([0, n, size, start + n, pad, start, 0], dtype=torch.int32)
        self._seq.copy_(seq.to(self.device, non_blocking=True))
        bt = torch.zeros(self.block_tables.shape[1], dtype=torch.int32)  # row 1 stays all null blocks
        bt[: len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        self.block_tables[0].copy_(bt.to(self.device, non_blocking=True))
        self.state_slots.copy_(torch.tensor([slot, 0], dtype=torch.int64).to(self.device, non_blocking=True))
        R = self.logits_indices.shape[0]
        assert 1 <= rows <= min(n, R), (rows, n, R)
        idx = list(range(n - rows, n)) + [n - 1] * (R - rows)
        self.logits_indices.copy_(torch.tensor(idx, dtype=torch.int64).to(self.device, non_blocking=True))

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return

        def prepare(size: int) -> None:  # one token of a request on the null slot and block
            self._fill(size, [0], 0, [0], 0)

        capture_graphs(self.device, self.sizes, prepare, self._forward, self.graphs, self.outputs)

    def run(
        self, tokens: list[int], start: int, block_ids: list[int], slot: int, rows: int = 1
    ) -> torch.Tensor:
        """The chunk's forward (tokens at positions start.., 1 < n <= max_tokens). -> logits
        [rows, V] fp32 of its last `rows` tokens (a graph's output buffer when replayed: read it
        before the next run)."""
        size = self.size_for(len(tokens))
        self._fill(size, tokens, start, block_ids, slot, rows)
        self.runs += 1
        if self.use_graphs:
            self.graphs[size].replay()
            return self.outputs[size][:rows]
        return self._forward(size, (len(tokens), start, slot))[:rows]
