"""CUDA graphs for pure-decode steps.

Inputs live in persistent buffers sliced `[:bs]`; one graph per padded batch size, captured
largest first into one memory pool. Padding rows are dummy requests that point at the null KV
block 0 and the null state slot 0, with no cached context. The captured region is the model
forward and lm_head; sampling runs after the replay.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from metainfer.model.meta import CacheTensors, ForwardMeta
from metainfer.model.qwen3_5_moe import Qwen3_5MoeModel


def default_capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    return [s for s in sizes if s < max_bs] + [max_bs]


class DecodeGraphs:
    def __init__(
        self,
        model: Qwen3_5MoeModel,
        caches: CacheTensors,
        max_bs: int,
        max_blocks: int,
        device: torch.device,
        capture_sizes: Sequence[int] | None = None,
        use_graphs: bool = True,
    ) -> None:
        self.model, self.caches, self.device = model, caches, device
        self.max_bs = max_bs
        self.sizes = sorted(capture_sizes or default_capture_sizes(max_bs))
        i32, i64 = torch.int32, torch.int64
        z = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = z(max_bs, dtype=i64)
        self.positions = z(max_bs, dtype=i64)
        self.slot_mapping = z(max_bs, dtype=i64)
        self.state_slots = z(max_bs, dtype=i64)
        self.context_lens = z(max_bs, dtype=i32)
        self.seq_lens = z(max_bs, dtype=i32)
        self.block_tables = z(max_bs, max_blocks, dtype=i32)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=i32, device=device)
        self.logits_indices = torch.arange(max_bs, dtype=i64, device=device)
        # one packed host staging buffer -> one H2D copy per step
        self._cols = 6
        pin = device.type == "cuda"
        self._host = torch.zeros(max_bs, self._cols, dtype=i64, pin_memory=pin)
        self._host_tables = torch.zeros(max_bs, max_blocks, dtype=i32, pin_memory=pin)
        self._dev_packed = z(max_bs, self._cols, dtype=i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.use_graphs = use_graphs and device.type == "cuda"

    def padded_size(self, bs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, bs)]

    def meta(self, bs: int, seq_lens_cpu: list[int] | None = None, state_slots_cpu: list[int] | None = None) -> ForwardMeta:
        """Metadata over the persistent buffers for a pure decode of `bs` rows. Host copies of the
        lengths are given on the eager path only: captured kernels read the device tensors."""
        seq_lens_cpu = seq_lens_cpu or []
        return ForwardMeta(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:bs],
            state_slots=self.state_slots[:bs],
            logits_indices=self.logits_indices[:bs],
            query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=seq_lens_cpu,
            context_lens_cpu=[n - 1 for n in seq_lens_cpu],
            state_slots_cpu=state_slots_cpu or [],
            num_decodes=bs,
            num_decode_tokens=bs,
        )

    def _forward(self, bs: int, seq_lens_cpu=None, state_slots_cpu=None) -> torch.Tensor:
        meta = self.meta(bs, seq_lens_cpu, state_slots_cpu)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], meta, self.caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        self._fill([], [], [], [], [], [], [], 0)  # all rows are padding
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):
                for _ in range(2):  # warm up (Triton compilation, autotuning) outside the graph
                    self._forward(bs)
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self.outputs[bs] = self._forward(bs)
                pool = g.pool()
                self.graphs[bs] = g
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def _fill(self, ids, positions, slot_mapping, state_slots, context_lens, seq_lens, tables, bs: int) -> int:
        """Stages one decode batch into the persistent buffers; returns the padded size."""
        pbs = self.padded_size(bs) if bs else self.max_bs
        h = self._host
        h[:pbs].zero_()
        if bs:
            h[:bs, 0] = torch.tensor(ids, dtype=torch.int64)
            h[:bs, 1] = torch.tensor(positions, dtype=torch.int64)
            h[:bs, 2] = torch.tensor(slot_mapping, dtype=torch.int64)
            h[:bs, 3] = torch.tensor(state_slots, dtype=torch.int64)
            h[:bs, 4] = torch.tensor(context_lens, dtype=torch.int64)
            h[:bs, 5] = torch.tensor(seq_lens, dtype=torch.int64)
        h[bs:pbs, 5] = 1  # padding rows: one token at position 0 in the null block, fresh state
        ht = self._host_tables
        ht[:pbs].zero_()
        for i, t in enumerate(tables):
            ht[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self._dev_packed[:pbs]
        dev.copy_(h[:pbs], non_blocking=True)
        self.block_tables[:pbs].copy_(ht[:pbs], non_blocking=True)
        self.input_ids[:pbs].copy_(dev[:, 0])
        self.positions[:pbs].copy_(dev[:, 1])
        self.slot_mapping[:pbs].copy_(dev[:, 2])
        self.state_slots[:pbs].copy_(dev[:, 3])
        self.context_lens[:pbs].copy_(dev[:, 4])
        self.seq_lens[:pbs].copy_(dev[:, 5])
        return pbs

    def run(self, ids, positions, slot_mapping, state_slots, context_lens, seq_lens, tables) -> torch.Tensor:
        """One decode step of bs rows -> logits [bs, V] fp32."""
        bs = len(ids)
        pbs = self._fill(ids, positions, slot_mapping, state_slots, context_lens, seq_lens, tables, bs)
        if self.use_graphs and pbs in self.graphs:
            self.graphs[pbs].replay()
            return self.outputs[pbs][:bs]
        pad = pbs - bs
        return self._forward(pbs, list(seq_lens) + [1] * pad, list(state_slots) + [0] * pad)[:bs]
