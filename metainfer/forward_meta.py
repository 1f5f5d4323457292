"""What a forward pass needs besides token ids and positions: batch layout and cache tensors.

Built by the engine, read by the model and the kernels; a leaf module (torch only), so neither
of those imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CacheTensors:
    """Device cache storage, owned by the runner. Index 0 of blocks and slots is a null entry that
    padded (dummy) requests write to; real requests never get it."""

    k: list[torch.Tensor]  # per full-attention layer: [num_blocks, block_size, Hkv, D]
    v: list[torch.Tensor]
    conv: list[torch.Tensor]  # per DeltaNet layer: [num_slots, K-1, conv_dim]
    ssm: list[torch.Tensor]  # per DeltaNet layer: [num_slots, Hv, Dk, Dv] fp32


@dataclass
class ForwardMeta:
    """Layout of one step. Sequences are ordered decodes first: the first `num_decodes` sequences
    have exactly one new token each, so tokens [:num_decodes] form a batched decode."""

    query_start_loc: torch.Tensor  # [B+1] int32, device
    seq_lens: torch.Tensor  # [B] int32 cached + new tokens, device
    context_lens: torch.Tensor  # [B] int32 tokens cached before this step, device
    block_tables: torch.Tensor  # [B, max_blocks] int32, device
    slot_mapping: torch.Tensor  # [T] int64 flat KV index (block * block_size + offset), device
    state_slots: torch.Tensor  # [B] int64 DeltaNet state slot, device
    logits_indices: torch.Tensor  # [num_logits] int64 token rows whose logits are computed, device
    # host copies for the per-sequence paths
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    context_lens_cpu: list[int]
    state_slots_cpu: list[int]
    num_decodes: int
    num_decode_tokens: int  # == num_decodes
    has_state: torch.Tensor | None = None  # [B] bool: context_lens > 0 (computed once per step)
    max_query_len: int | None = None  # set by a prefill CUDA graph: its grids' bound (`prefill_max_len`)
    _prefill_cu: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.has_state is None:
            self.has_state = self.context_lens > 0

    def prefill_max_len(self) -> int:
        """The longest prefill chunk of the step: sizes the prefill kernels' grids (the kernels read
        the actual lengths from the device offsets, so a captured graph gives its bucket size)."""
        if self.max_query_len is not None:
            return self.max_query_len
        q, nd = self.query_start_loc_cpu, self.num_decodes
        return max((q[i + 1] - q[i] for i in range(nd, self.num_seqs)), default=0)

    def prefill_offsets(self) -> torch.Tensor:
        """[P+1] int32 device offsets of the prefilling sequences from their first token (the
        DeltaNet layers' varlen kernels); computed once per step, a view when no decodes lead."""
        if self._prefill_cu is None:
            nd = self.num_decodes
            s0 = self.query_start_loc_cpu[nd]
            qsl = self.query_start_loc[nd:]
            self._prefill_cu = qsl - s0 if s0 else qsl
        return self._prefill_cu

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        state_slots: list[int],
        block_size: int,
        logits_rows: list[int],
        device: torch.device | str,
        max_blocks: int | None = None,
    ) -> ForwardMeta:
        """Builds the metadata from host lists (the eager path; CUDA graphs use persistent buffers)."""
        B = len(query_lens)
        num_decodes = 0
        while num_decodes < B and query_lens[num_decodes] == 1:
            num_decodes += 1
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        slot_mapping: list[int] = []
        for b in range(B):
            table = block_tables[b]
            for pos in range(context_lens[b], seq_lens[b]):
                slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        width = max_blocks or max((len(t) for t in block_tables), default=1) or 1
        bt = torch.zeros(B, width, dtype=torch.int32)
        for b, t in enumerate(block_tables):
            if t:
                bt[b, : len(t)] = torch.tensor(t, dtype=torch.int32)

        def dev(x: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

        return cls(
            query_start_loc=dev(qsl, torch.int32),
            seq_lens=dev(seq_lens, torch.int32),
            context_lens=dev(context_lens, torch.int32),
            block_tables=bt.to(device, non_blocking=True),
            slot_mapping=dev(slot_mapping, torch.int64),
            state_slots=dev(state_slots, torch.int64),
            logits_indices=dev(logits_rows, torch.int64),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=list(context_lens),
            state_slots_cpu=list(state_slots),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
        )
