"""CUDA graphs for a lone prefill: one request's prompt (or its last chunk) alone in a step, the
idle server's TTFT case. An eager 1k-token prefill makes ~1,100 launches whose host time exceeds
their GPU time; a replay is one launch.

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

import numpy as np
import torch

from metainfer.engine.cuda_graph import capture_graphs
from metainfer.forward_meta import CacheTensors, ForwardMeta
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
        R = logits_rows
        # two device buffers, each filled by one host->device copy per step (from `_Staging`)
        self._i64 = torch.zeros(3 * S + 2 + R, dtype=i64, device=device)
        self._tok = self._i64[: 3 * S].view(3, S)  # input ids, positions, KV slot of each token
        self.input_ids, self.positions, self.slot_mapping = self._tok
        self.state_slots = self._i64[3 * S : 3 * S + 2]
        self.logits_indices = self._i64[3 * S + 2 :]  # the chunk's last rows (the last repeated)
        # query_start_loc [3] | seq_lens [2] | context_lens [2] | the request's block count | block
        # tables [2, max_blocks]
        # (row 1: the padding sequence, all null blocks, never written)
        self._i32 = torch.zeros(8 + 2 * max_blocks, dtype=i32, device=device)
        self._seq = self._i32[:7]
        self.query_start_loc, self.seq_lens, self.context_lens = self._seq[:3], self._seq[3:5], self._seq[5:7]
        self.block_tables = self._i32[8:].view(2, max_blocks)
        self.num_blocks = self._i32[7:8]  # the request's blocks (past them, row 0's entries are stale)
        self._staging = _Staging(self._i64, self._i32[: 8 + max_blocks], device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # size -> the forward's final hidden states [size, H]
        self.last_hidden: torch.Tensor | None = None  # the last run's, [n, H] (read before the next run)
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
        self.hidden[size] = hidden  # captured: the graph's output buffer (the MTP drafter reads it)
        return self.model.compute_logits(hidden[meta.logits_indices])  # [logits_rows, V] fp32

    def _fill(
        self, size: int, tokens: list[int], start: int, block_ids: list[int], slot: int, rows: int = 1
    ) -> None:
        """Stages the chunk tokens[0:n] at positions start.. of a request (its KV blocks, its state
        slot) and the padding sequence behind it; logits for its last `rows` tokens. Two copies: the
        int64 buffer whole, the int32 one up to the request's last block (row 0's entries past it
        are stale and never read: kernels read blocks below seq_len only)."""
        n, bs, pad, S = len(tokens), self.block_size, size - len(tokens), self.sizes[-1]
        assert 0 < n <= size and len(block_ids) * bs >= start + n, (n, size, start, len(block_ids))
        R = self.logits_indices.shape[0]
        assert 1 <= rows <= min(n, R), (rows, n, R)
        h64, h32 = self._staging.next()  # numpy views of the pinned staging set
        pos = np.arange(start, start + n)
        bids = np.asarray(block_ids, dtype=np.int64)
        h64[:n] = tokens
        h64[n:size] = 0
        h64[S : S + n] = pos
        h64[S + n : S + size] = np.arange(pad)
        h64[2 * S : 2 * S + n] = bids[pos // bs] * bs + pos % bs
        h64[2 * S + n : 2 * S + size] = np.arange(pad) % bs  # the padding sequence: null block 0
        h64[3 * S : 3 * S + 2] = (slot, 0)
        h64[3 * S + 2 : 3 * S + 2 + rows] = np.arange(n - rows, n)
        h64[3 * S + 2 + rows :] = n - 1
        h32[:8] = (0, n, size, start + n, pad, start, 0, len(block_ids))
        h32[8 : 8 + len(block_ids)] = bids
        self._staging.copy(8 + len(block_ids))

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
            self.last_hidden = self.hidden[size][: len(tokens)]
            return self.outputs[size][:rows]
        logits = self._forward(size, (len(tokens), start, slot))[:rows]
        self.last_hidden = self.hidden.pop(size)[: len(tokens)]
        return logits


class _Staging:
    """Host staging for PrefillGraphs' two device buffers: pinned on CUDA (a non-blocking copy),
    two sets used in turn, and a set is rewritten only after the copy that last read it ran
    (its event), so a step launched behind an unfinished one never sees the host's next writes."""

    def __init__(self, d64: torch.Tensor, d32: torch.Tensor, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.dev = (d64, d32)
        self.sets = [
            (
                torch.zeros(d64.shape, dtype=d64.dtype, pin_memory=pin),
                torch.zeros(d32.shape, dtype=d32.dtype, pin_memory=pin),
            )
            for _ in range(2)
        ]
        self.views = [(a.numpy(), b.numpy()) for a, b in self.sets]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.i = 0
        self.cuda = pin

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """The next set, as numpy views (host writes), once its last copy has run."""
        self.i ^= 1
        if self.events[self.i] is not None:
            self.events[self.i].synchronize()
        return self.views[self.i]

    def copy(self, n32: int) -> None:
        """Enqueues the current set's copies: the int64 buffer whole, the int32 one's first n32."""
        h64, h32 = self.sets[self.i]
        d64, d32 = self.dev
        d64.copy_(h64, non_blocking=self.cuda)
        d32[:n32].copy_(h32[:n32], non_blocking=self.cuda)
        if self.cuda:
            ev = self.events[self.i] or torch.cuda.Event()
            ev.record()
            self.events[self.i] = ev
