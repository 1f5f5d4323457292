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
drafting (`writes_kv`), and is rewritten from real hidden rows once those positions are accepted.
Greedy argmax per draft, one host sync each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metainfer.engine.request import Request
from metainfer.model.meta import CacheTensors, ForwardMeta
from metainfer.model.qwen3_5_moe import Qwen3_5MoeModel


@dataclass
class MTPState:
    hidden: torch.Tensor | None = None  # [rows, H] main-model hidden states of positions hidden_pos..
    hidden_pos: int = 0
    done: int = 0  # MTP KV final for positions < done
    lost: bool = False  # rows it needed were dropped (a gap, or more than MAX_PENDING_ROWS undrafted)


# hidden rows held per request while it is not drafting (more sequences running than
# speculative_max_seqs): past this many (8 MB at H = 2,048 in BF16) they are dropped with its MTP drafts
MAX_PENDING_ROWS = 2048


class MTPDrafter:
    writes_kv = True  # drafts k >= 2 write MTP KV past the last token: the scheduler grows first

    def __init__(self, model: Qwen3_5MoeModel, caches: CacheTensors, block_size: int, device: torch.device):
        if model.mtp is None:
            raise ValueError("speculative='mtp' needs a model with an MTP layer (mtp_num_hidden_layers >= 1)")
        n_full = len(model.cfg.full_layer_ids)
        if len(caches.k) != n_full + 1:
            raise ValueError(f"the MTP layer needs its own KV cache: {n_full + 1} full-attention caches")
        self.model, self.caches, self.block_size, self.device = model, caches, block_size, device

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
        st.done = min(st.done, start)  # MTP rows from `start` on read the rows recomputed now
        if st.hidden is not None and st.hidden_pos <= start <= st.hidden_pos + st.hidden.shape[0]:
            st.hidden = torch.cat([st.hidden[: start - st.hidden_pos], rows])
        else:  # the first rows, or a resume after a preemption (start 0: the MTP KV went too)
            st.hidden, st.hidden_pos = rows.clone(), start
        if st.done < st.hidden_pos or st.hidden.shape[0] > MAX_PENDING_ROWS:
            st.hidden, st.lost = None, True  # rows it needs are gone: no MTP drafts for it any more
            return
        keep = st.done - st.hidden_pos  # rows below `done` are never read again
        if keep > 0:
            st.hidden, st.hidden_pos = st.hidden[keep:], st.done

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
        ids = torch.tensor(req.tokens_slice(t0 + 1, t1 + 1), dtype=torch.int64, device=self.device)
        h = self._rows(req, ids, hidden, t0)
        st.done = t1
        drafts: list[int] = []
        for i in range(k):
            tok = int(self.model.compute_logits(h[-1:]).argmax(dim=-1).item())
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
        )
        pos = torch.arange(start, start + n, dtype=torch.int64, device=self.device)
        m = self.model
        return m.mtp(m.embed_tokens(ids), hidden.to(m.embed_tokens.weight.dtype), pos, meta, self.caches)
