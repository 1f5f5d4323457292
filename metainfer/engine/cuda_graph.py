"""CUDA graphs for pure-decode steps.

Inputs live in persistent buffers sliced `[:bs]`; one graph per padded batch size, captured
largest first into one memory pool. Padding rows are dummy requests that point at the null KV
block 0 and the null state slot 0, with no cached context. The captured region is the step's
inputs made the model's (a pending token from the token buffer, the lengths as int32:
kernels.decode_io), the model forward, lm_head (logits in the model's dtype) and the greedy tokens
(argmax into the token buffer); sampling other than greedy runs after the replay.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from metainfer.forward_meta import CacheTensors, ForwardMeta
from metainfer.kernels import ops
from metainfer.model.qwen3_5_moe import Qwen3_5MoeModel


def capture_graphs(device: torch.device, sizes, prepare, forward, graphs: dict, outputs: dict) -> None:
    """One graph per size into graphs[size] (output tensor: outputs[size]), largest first into one
    memory pool, on a side stream: prepare(size) stages its inputs, forward(size) is run twice
    outside the graph (Triton compilation) and then captured."""
    pool = None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for size in sorted(sizes, reverse=True):
            prepare(size)
            for _ in range(2):
                forward(size)
            torch.cuda.synchronize(device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                outputs[size] = forward(size)
            pool = g.pool()
            graphs[size] = g
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)


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
        num_slots: int,
        device: torch.device,
        capture_sizes: Sequence[int] | None = None,
        use_graphs: bool = True,
        tok_buf: torch.Tensor | None = None,
    ) -> None:
        self.model, self.caches, self.device = model, caches, device
        self.max_bs = max_bs
        self.sizes = sorted(capture_sizes or default_capture_sizes(max_bs))
        i32, i64 = torch.int32, torch.int64
        z = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        pin = device.type == "cuda"
        # packed per-row inputs: ids, positions, slot_mapping, state_slot, context_len, seq_len, and the
        # row of tok_buf holding a pending token (-1: ids has the token)
        self._cols = 7
        self._host = torch.zeros(self._cols, max_bs, dtype=i64, pin_memory=pin)
        self._packed = z(self._cols, max_bs, dtype=i64)  # rows stay contiguous when sliced [:bs]
        self.input_ids, self.positions, self.slot_mapping, self.state_slots = (
            self._packed[i] for i in range(4)
        )
        self.context_lens = z(max_bs, dtype=i32)
        self.seq_lens = z(max_bs, dtype=i32)
        # the token buffer: the last step's sampled tokens by row (read for pending tokens); a replay
        # writes its rows' greedy tokens into tok_buf[:size] (the runner's, shared with its other paths)
        self.tok_buf = tok_buf if tok_buf is not None else z(max_bs, dtype=i64)
        assert self.tok_buf.shape[0] >= max_bs and self.tok_buf.dtype == i64
        # block tables indexed by state slot (row 0: the null slot, all null blocks); a step gathers
        # its rows on the device, so the host only writes the blocks a request newly received
        self.host_slot_tables = torch.zeros(num_slots + 1, max_blocks, dtype=i32, pin_memory=pin)
        self.slot_tables = z(num_slots + 1, max_blocks, dtype=i32)
        self._synced: dict[int, tuple[str, int]] = {}  # slot -> (request id, blocks written)
        self._tables_dirty = True
        self._copied: torch.cuda.Event | None = None  # after the last step's host->device copies
        self.query_start_loc = torch.arange(max_bs + 1, dtype=i32, device=device)
        self.logits_indices = torch.arange(max_bs, dtype=i64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # size -> the forward's final hidden states [size, H]
        self.last_hidden: torch.Tensor | None = None  # the last run's, [bs, H] (read before the next run)
        self.use_graphs = use_graphs and device.type == "cuda"

    def padded_size(self, bs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, bs)]

    def meta(
        self, bs: int, seq_lens_cpu: list[int] | None = None, state_slots_cpu: list[int] | None = None
    ) -> ForwardMeta:
        """Metadata over the persistent buffers for a pure decode of `bs` rows. Host copies of the
        lengths are given on the eager path only: captured kernels read the device tensors."""
        seq_lens_cpu = seq_lens_cpu or []
        return ForwardMeta(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            context_lens=self.context_lens[:bs],
            block_tables=self.slot_tables.index_select(0, self.state_slots[:bs]),
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
        ops.decode_inputs(self._packed, self.tok_buf, bs, self.context_lens, self.seq_lens)
        meta = self.meta(bs, seq_lens_cpu, state_slots_cpu)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], meta, self.caches)
        self.hidden[bs] = hidden  # captured: the graph's output buffer (the MTP drafter reads it)
        logits = self.model.lm_logits(hidden)  # [bs, V] in the model's dtype (fp32 only on demand)
        ops.argmax_rows(logits, self.tok_buf)
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        self._fill([], 0)  # all rows are padding
        capture_graphs(self.device, self.sizes, lambda bs: None, self._forward, self.graphs, self.outputs)

    def recapture(self) -> None:
        """The graphs dropped and captured again, so that kernel switches read while capturing take their
        current values (benchmarks/ab_inproc.py's in-process A/B). With no request running only: the
        capture rewrites the padding inputs and the token buffer's rows."""
        self.graphs.clear()
        self.outputs.clear()
        self.hidden.clear()
        self.last_hidden = None
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the old graphs' pool (else each recapture keeps one more)
        self.capture()

    def sync_tables(self, slot: int, owner_key: str, block_ids: list[int]) -> None:
        """Writes the blocks of the request now holding `slot` that the device table lacks.
        `owner_key` must change whenever the slot's blocks are reassigned (new request, preemption)."""
        owner, n = self._synced.get(slot, ("", 0))
        if owner != owner_key:
            n = 0
        if len(block_ids) > n:
            self._host_free()
            row = self.host_slot_tables[slot]
            row[n : len(block_ids)] = torch.tensor(block_ids[n:], dtype=torch.int32)
            self._synced[slot] = (owner_key, len(block_ids))
            self._tables_dirty = True

    def _fill(self, rows: list[tuple[int, int, int, int, int]], bs: int) -> int:
        """Stages one decode batch (token, position, kv slot, state slot, pending source per row:
        the row of tok_buf holding the token, or -1) into the buffers; returns the padded size.
        Padding rows decode one token at position 0 on the null slot."""
        pbs = self.padded_size(bs) if bs else self.max_bs
        self._host_free()
        h = self._host
        h[:, :pbs].zero_()
        h[6, :pbs] = -1
        if bs:
            t = torch.tensor(rows, dtype=torch.int64).t()  # [5, bs]
            h[:4, :bs] = t[:4]
            h[4, :bs] = t[1]
            h[5, :bs] = t[1] + 1
            h[6, :bs] = t[4]
        h[5, bs:pbs] = 1
        self._packed[:, :pbs].copy_(h[:, :pbs], non_blocking=True)
        if self._tables_dirty:
            self.slot_tables.copy_(self.host_slot_tables, non_blocking=True)
            self._tables_dirty = False
        if self.device.type == "cuda":
            self._copied = self._copied or torch.cuda.Event()
            self._copied.record()
        return pbs

    def _host_free(self) -> None:
        """Waits until the last step's non-blocking copies have read the pinned host buffers, before
        the host rewrites them (in the async loop the step before it has finished by then, so this
        rarely waits: the copies run right behind it)."""
        if self._copied is not None:
            self._copied.synchronize()

    def run(self, rows: list[tuple[int, int, int, int, int]]) -> torch.Tensor:
        """One decode step; rows are (token, position, kv slot, state slot, pending source: a row of
        tok_buf or -1). -> logits [bs, V] in the model's dtype; tok_buf[:bs] = their argmax."""
        bs = len(rows)
        pbs = self._fill(rows, bs)
        self.last_hidden = None
        if self.use_graphs and pbs in self.graphs:
            self.graphs[pbs].replay()
            self.last_hidden = self.hidden[pbs][:bs]
            return self.outputs[pbs][:bs]
        pad = pbs - bs
        seq_lens = [r[1] + 1 for r in rows] + [1] * pad
        logits = self._forward(pbs, seq_lens, [r[3] for r in rows] + [0] * pad)[:bs]
        self.last_hidden = self.hidden.pop(pbs)[:bs]
        return logits
