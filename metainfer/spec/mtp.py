"""Drafts from the checkpoint's multi-token-prediction head (`model.MTP`, one full-attention MoE layer).

MTP row t reads the main model's final (normed) hidden state at position t and the embedding of token
t + 1, attends over the MTP layer's own KV cache (rows 0..t, in the sequence's blocks of an extra
full-attention cache, `caches.k[n_full]`), and its logits (the shared lm_head) predict token t + 2.

Per request (`MTPState`, on `Request.spec_index`):
- `hidden`: the main model's hidden rows of positions [hidden_pos, hidden_pos + len), as the runner
  notes them after every step (`note`): a step over positions [start, start + n) replaces the rows
  from `start` on. Rows of rejected drafts get noted too and are never read: drafting reads rows below
  the last accepted position only, and a rejection recomputes the positions after it.
- `done`: MTP rows below it have their final KV (inputs: real hidden rows, real next tokens).

`propose(req, k)` with the sequence's L tokens on the host: MTP rows done..L-2 in one chunk (their
KV final; row L-2 sees the last token L-1 and predicts token L: draft 1), then draft i + 1 from row
L-2+i fed its own previous output row as the hidden state and draft i as the token (vLLM's chained
MTP). Those rows' KV sits at positions L-1..L+k-3, inside the blocks the scheduler grows before
drafting (`Scheduler(draft_kv=True)`), and is rewritten from real hidden rows once those positions
are accepted. Greedy argmax per draft, one host sync each on the eager path.

`MTPGraphs` (where the lone-prefill graphs run) captures the whole proposal for catch-up chunks of up
to 2 * (K + 1) rows: the chunk in the lone-prefill layout (`PrefillGraphs`: the chunk, then a padding
sequence on the null block), then the K - 1 chained rows as single-row decodes, each draft's argmax
feeding the next row's embedding on the device; one replay and one host sync per proposal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from metainfer.engine.prefill_graph import PrefillGraphs
from metainfer.engine.request import Request
from metainfer.forward_meta import CacheTensors, ForwardMeta
from metainfer.model.qwen3_5_moe import Qwen3_5MoeModel


@dataclass
class MTPState:
    hidden: torch.Tensor | None = None  # [rows, H] main-model hidden states of positions hidden_pos..
    hidden_pos: int = 0
    done: int = 0  # MTP KV final for positions < done
    lost: bool = False  # rows it needed were dropped (a gap, or more than MAX_PENDING_ROWS undrafted)


# hidden rows held per request while it is not drafting (more sequences running than
# speculative_max_seqs): past this many (8 MB at H = 2,048 in BF16) they are dropped with its MTP drafts,
# and so are the rows of a request that would take all requests' rows past MAX_TOTAL_ROWS (64 MB)
MAX_PENDING_ROWS = 2048
MAX_TOTAL_ROWS = 16384
def draft_head(model: Qwen3_5MoeModel, vocab: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """The drafts' logits: the model's lm_head, or only its first `vocab` rows (> 0: a draft among the
    ids below it; BPE ranks run roughly by frequency, so the first 32,768 ids hold most tokens of text
    in 1/8 of lm_head's bytes). A draft only proposes: the
    verify's logits stay the model's, so this changes which drafts come, never an output. An FP8 head
    (--fp8-lm-head) gives its first `vocab` rows with their 128-row scale blocks (vocab a multiple of
    128; else the whole head)."""
    w = model.embed_tokens.weight if model.cfg.tie_word_embeddings else model.lm_head.weight
    if not 0 < vocab < w.shape[0]:
        return model.compute_logits
    from metainfer.kernels import ops

    rows = w.data[:vocab]
    if w.dtype == torch.float8_e4m3fn:
        if vocab % 128:
            return model.compute_logits
        srows = model.lm_head.weight_scale_inv[: vocab // 128]
        return lambda h: ops.fp8_linear(h, rows, srows).float()
    return lambda h: ops.linear(h, rows).float()


class MTPDrafter:
    def __init__(self, model: Qwen3_5MoeModel, caches: CacheTensors, block_size: int, device: torch.device,
                 draft_vocab: int = 0, max_blocks: int | None = None):
        if model.mtp is None:
            raise ValueError("speculative='mtp' needs a model with an MTP layer (mtp_num_hidden_layers >= 1)")
        n_full = len(model.cfg.full_layer_ids)
        if len(caches.k) != n_full + 1:
            raise ValueError(f"the MTP layer needs its own KV cache: {n_full + 1} full-attention caches")
        self.model, self.caches, self.block_size, self.device = model, caches, block_size, device
        self.max_blocks = max_blocks  # the eager rows' block-table width (the engine's: capacity)
        self.graphs: MTPGraphs | None = None  # set by the runner where the lone-prefill graphs run
        self.total_rows = 0  # hidden rows held over all requests (`note`, `forget`)
        self.logits = draft_head(model, draft_vocab)

    @staticmethod
    def state(req: Request) -> MTPState:
        if not isinstance(req.spec_index, MTPState):
            req.spec_index = MTPState()
        return req.spec_index

    def note(self, req: Request, start: int, rows: torch.Tensor) -> None:
        """The main model's hidden rows [n, H] of positions start..start+n-1 (this step's), kept for
        a request that drafts (`Request.draftable`) until its MTP rows have read them."""
        if not req.draftable:
            return
        st = self.state(req)
        if st.lost:
            return
        held = 0 if st.hidden is None else st.hidden.shape[0]
        st.done = min(st.done, start)  # MTP rows from `start` on read the rows recomputed now
        if st.hidden is not None and st.hidden_pos <= start <= st.hidden_pos + st.hidden.shape[0]:
            st.hidden = torch.cat([st.hidden[: start - st.hidden_pos], rows])
        else:  # the first rows, or a resume after a preemption (start 0: the MTP KV went too)
            st.hidden, st.hidden_pos = rows.clone(), start
        keep = st.done - st.hidden_pos  # rows below `done` are never read again
        if keep > 0:
            st.hidden, st.hidden_pos = st.hidden[keep:], st.done
        rows_now = st.hidden.shape[0]
        if (keep < 0 or rows_now > MAX_PENDING_ROWS
                or self.total_rows - held + rows_now > MAX_TOTAL_ROWS):
            st.hidden, st.lost = None, True  # rows it needs are gone: no MTP drafts for it any more
            rows_now = 0
        self.total_rows += rows_now - held

    def forget(self, req: Request) -> None:
        """A finished request's rows go (the engine calls this as it finishes one)."""
        st = req.spec_index
        if isinstance(st, MTPState) and st.hidden is not None:
            self.total_rows -= st.hidden.shape[0]
            st.hidden = None

    @torch.inference_mode()
    def propose(self, req: Request, k: int) -> list[int]:
        st = self.state(req)
        L = req.num_tokens
        t0, t1 = st.done, L - 1  # MTP rows t0..t1-1 (inputs: hidden t, token t + 1)
        if st.hidden is None or k < 1 or t1 <= t0 or t0 < st.hidden_pos:  # (lost, or nothing new)
            return []
        if st.hidden_pos + st.hidden.shape[0] < t1:  # the last rows are not computed yet
            return []
        hidden = st.hidden[t0 - st.hidden_pos : t1 - st.hidden_pos]
        g = self.graphs
        if g is not None and k <= g.k:
            if t1 - t0 > g.max_tokens:  # a long catch-up (after a prefill): all but its last row eager
                ids = torch.tensor(req.tokens_slice(t0 + 1, t1), dtype=torch.int64, device=self.device)
                self._rows(req, ids, hidden[:-1], t0)
                t0, hidden = t1 - 1, hidden[-1:]
            drafts = g.run(req.tokens_slice(t0 + 1, t1 + 1), hidden, t0, req.block_ids, req.state_slot)
            st.done = t1
            return drafts[:k]
        ids = torch.tensor(req.tokens_slice(t0 + 1, t1 + 1), dtype=torch.int64, device=self.device)
        h = self._rows(req, ids, hidden, t0)
        st.done = t1
        drafts: list[int] = []
        for i in range(k):
            tok = int(self.logits(h[-1:]).argmax(dim=-1).item())
            drafts.append(tok)
            if i + 1 < k:
                h = self._rows(req, torch.tensor([tok], device=self.device), h[-1:], t1 + i)
        return drafts

    def _rows(self, req: Request, ids: torch.Tensor, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """MTP rows start..start+n-1 (context: the MTP KV below start) -> their normed outputs [n, H]."""
        n = ids.shape[0]
        assert len(req.block_ids) * self.block_size >= start + n, (len(req.block_ids), start, n)
        meta = ForwardMeta.build(
            query_lens=[n],
            context_lens=[start],
            block_tables=[req.block_ids],
            state_slots=[req.state_slot],
            block_size=self.block_size,
            logits_rows=[n - 1],
            device=self.device,
            max_blocks=self.max_blocks,
        )
        pos = torch.arange(start, start + n, dtype=torch.int64, device=self.device)
        m = self.model
        return m.mtp(m.embed_tokens(ids), hidden.to(m.embed_tokens.weight.dtype), pos, meta, self.caches)


def _row_meta(g: PrefillGraphs, seq_lens: torch.Tensor, context_lens: torch.Tensor, kv_slot: torch.Tensor,
              qsl1: torch.Tensor, row0: torch.Tensor, host: tuple[int, int] | None) -> ForwardMeta:
    """A chained MTP row as a one-row decode of the lone chunk's request (its block-table row and
    state slot in `g`'s buffers). host = (position, state slot) on the eager path only: captured
    kernels read the device tensors, as `DecodeGraphs`' metas."""
    p, slot = host or (0, 0)
    return ForwardMeta(
        query_start_loc=qsl1,
        seq_lens=seq_lens,
        context_lens=context_lens,
        block_tables=g.block_tables[:1],
        slot_mapping=kv_slot,
        state_slots=g.state_slots[:1],
        logits_indices=row0,
        query_start_loc_cpu=[0, 1],
        seq_lens_cpu=[p + 1] if host else [],
        context_lens_cpu=[p] if host else [],
        state_slots_cpu=[slot] if host else [],
        num_decodes=1,
        num_decode_tokens=1,
    )


class MTPGraphs(PrefillGraphs):
    """A proposal of K drafts in one replay (see the module doc), in PrefillGraphs' lone-chunk layout.
    The chunk's token ids are the next tokens (t + 1 of each MTP row t), its hidden rows go to
    `hidden_in`; draft 1 from its last row, then K - 1 chained one-row decodes at the next positions
    (`_propose`), their KV slots read from the request's block-table row on the device (a position
    past its blocks, staged count `num_blocks`, writes to the null block: only drafts past the k asked
    for read it back)."""

    def __init__(self, model: Qwen3_5MoeModel, caches: CacheTensors, k: int, max_blocks: int,
                 block_size: int, device: torch.device, use_graphs: bool = True,
                 logits: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        sizes = sorted({1, 2, 4, k + 1, 2 * (k + 1)})
        super().__init__(model, caches, sizes, max_blocks, block_size, device, use_graphs=use_graphs)
        self.k = k
        self.draft_logits = logits or model.compute_logits
        self._qsl1 = torch.tensor([0, 1], dtype=torch.int32, device=device)
        self._row0 = torch.zeros(1, dtype=torch.int64, device=device)
        dt = model.embed_tokens.weight.dtype
        self.hidden_in = torch.zeros(self.sizes[-1], model.cfg.hidden_size, dtype=dt, device=device)

    def _forward(self, size: int, host: tuple[int, int, int] | None = None) -> torch.Tensor:
        m = self.model
        meta = self._meta(size, host)
        h = m.mtp(m.embed_tokens(self.input_ids[:size]), self.hidden_in[:size], self.positions[:size], meta,
                  self.caches)
        self.hidden[size] = h  # (PrefillGraphs' contract; unused here)
        return torch.cat(self._propose(h, host[2] if host else None))  # [K]

    def _propose(self, h: torch.Tensor, slot: int | None) -> list[torch.Tensor]:
        """Drafts 1..K ([1] int64 each) after the chunk's last MTP output row (h: the chunk's rows).
        slot: the request's state slot on the eager path (the chained rows' host lengths), else None."""
        m, bs, i32 = self.model, self.block_size, torch.int32
        row = self.logits_indices[:1]
        last = h.index_select(0, row)  # [1, H]
        tok = self.draft_logits(last).argmax(dim=-1)
        drafts = [tok]
        pos = self.positions.index_select(0, row)
        nb = self.num_blocks.to(torch.int64)
        for _ in range(self.k - 1):  # draft i + 2: the previous row's output and draft i + 1
            pos = pos + 1
            blk = pos // bs
            block = self.block_tables[0].index_select(0, torch.minimum(blk, nb - 1)).to(torch.int64)
            kv = torch.where(blk < nb, block * bs, 0) + pos % bs
            host = (int(pos.item()), slot) if slot is not None else None
            meta = _row_meta(self, (pos + 1).to(i32), pos.to(i32), kv, self._qsl1, self._row0, host)
            last = m.mtp(m.embed_tokens(tok), last, pos, meta, self.caches)
            tok = self.draft_logits(last).argmax(dim=-1)
            drafts.append(tok)
        return drafts

    def run(self, tokens: list[int], hidden: torch.Tensor, start: int, block_ids: list[int], slot: int,
            rows: int = 1) -> list[int]:
        """K drafts after MTP rows start..start+n-1 (tokens: their next tokens, hidden: their rows)."""
        n = len(tokens)
        size = self.size_for(n)
        self._fill(size, tokens, start, block_ids, slot, 1)
        self.hidden_in[:n].copy_(hidden)
        self.runs += 1
        if self.use_graphs:
            self.graphs[size].replay()
            out = self.outputs[size]
        else:
            out = self._forward(size, (n, start, slot))
            self.hidden.pop(size)
        return out.tolist()  # the host sync
