"""A step's inputs, built once from the scheduled batch (`StepInputs`), and the three executors that run them
behind one interface (`Executor`): the decode CUDA graphs, the lone-prefill CUDA graphs and the eager forward.
Each stages the inputs into its own device buffers (the graphs' persistent ones: `DecodeGraphs`,
`PrefillGraphs`) and returns the step's logits and final hidden states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from metainfer.engine.cuda_graph import DecodeGraphs
from metainfer.engine.prefill_graph import PrefillGraphs
from metainfer.engine.request import Request
from metainfer.forward_meta import CacheTensors, ForwardMeta
from metainfer.model.qwen3_5_moe import Qwen3_5MoeModel

PENDING = -1  # placeholder for a token sampled by a step whose results are not on the host yet

Owner = tuple[Request, str, int]  # a logits row's (request, "sample" | "prompt" | "verify", position)


def verify_owners(req: Request, start: int, real: int, n: int) -> list[Owner]:
    """A verify chunk's logits rows (of its n tokens, `real` of them the sequence's own): after the last real
    token, then after each draft."""
    return [(req, "verify", start + j) for j in range(real - 1, n)]


@dataclass
class StepInputs:
    """One step on the host. items: (request, tokens this step: its own from num_computed_tokens, then its
    drafts), decodes first. owners: the logits rows the step reads, in token order. prev_rows: request id ->
    the previous step's token-buffer row of its sampled token (where a PENDING last token is read, on the
    device)."""

    items: list[tuple[Request, int]]
    owners: list[Owner]
    prev_rows: dict[str, int]

    @classmethod
    def build(cls, items: list[tuple[Request, int]], prev_rows: dict[str, int]) -> StepInputs:
        owners: list[Owner] = []
        for req, n in items:
            start = req.num_computed_tokens
            real = n - len(req.draft_token_ids)
            if req.draft_token_ids:
                owners.extend(verify_owners(req, start, real, n))
            elif req.score_only or (
                req.params.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens
            ):
                owners.extend((req, "prompt", start + j) for j in range(n))
            elif start + n == req.num_tokens:
                owners.append((req, "sample", start + n - 1))
        return cls(items, owners, prev_rows)

    def source(self, i: int) -> int:
        """The previous step's token-buffer row holding sequence i's last real token where it is PENDING,
        else -1."""
        req, n = self.items[i]
        last = req.num_computed_tokens + n - len(req.draft_token_ids) - 1
        if n == len(req.draft_token_ids) or req.token_at(last) != PENDING:
            return -1
        assert last == req.num_tokens - 1, "only a request's last token can still be pending"
        return self.prev_rows[req.request_id]

    def tokens(self, i: int) -> list[int]:
        """Sequence i's input ids: its own tokens (a PENDING one as 0: the device reads it, `source`), then
        its drafts."""
        req, n = self.items[i]
        start = req.num_computed_tokens
        toks = req.tokens_slice(start, start + n - len(req.draft_token_ids))
        if toks and toks[-1] == PENDING:
            toks = toks[:-1] + [0]
        return toks + req.draft_token_ids

    def logits_rows(self) -> list[int]:
        """Each owner's row in the step's tokens laid back to back in item order."""
        offset, base = {}, 0
        for req, n in self.items:
            offset[req.request_id] = base - req.num_computed_tokens
            base += n
        return [offset[req.request_id] + p for req, _, p in self.owners]


class Executor(Protocol):
    """Runs a step's forward and the logits of its owners' rows."""

    path: str  # InFlight.path: "decode_graph" | "prefill_graph" | "eager"
    argmaxed: bool  # its logits come in the model's dtype, their argmax already in the token buffer

    def supports(self, inputs: StepInputs) -> bool:
        """Whether it runs this step."""
        ...

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor]:
        """-> (logits [len(owners), V] or None when the step reads none, the final hidden states [T, H] of
        the step's tokens in item order). The graphs' tensors are their output buffers: read them before the
        next run."""
        ...


def decode_only(items: list[tuple[Request, int]]) -> bool:
    """Every sequence decodes its one last token (no drafts, no scoring, no prompt logprobs left)."""
    return all(
        n == 1
        and r.num_computed_tokens == r.num_tokens - 1
        and not r.score_only
        and (r.params.prompt_logprobs is None or len(r.prompt_logprobs) >= r.num_prompt_tokens)
        for r, n in items
    )


class DecodeExecutor:
    """A pure decode step on the decode graphs (on the CPU: their persistent buffers, no graph)."""

    path, argmaxed = "decode_graph", True

    def __init__(self, graphs: DecodeGraphs, block_size: int) -> None:
        self.graphs, self.block_size = graphs, block_size

    def supports(self, inputs: StepInputs) -> bool:
        return len(inputs.items) <= self.graphs.max_bs and decode_only(inputs.items)

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        bs_ = self.block_size
        rows = []
        for i, (r, _) in enumerate(inputs.items):
            p = r.num_computed_tokens
            self.graphs.sync_tables(r.state_slot, f"{r.request_id}#{r.num_preemptions}", r.block_ids)
            src = inputs.source(i)
            tok = r.token_at(p) if src < 0 else 0
            rows.append((tok, p, r.block_ids[p // bs_] * bs_ + p % bs_, r.state_slot, src))
        logits = self.graphs.run(rows)
        return logits, self.graphs.last_hidden


class PrefillExecutor:
    """One request's chunk alone in the step, ending its tokens (then its drafts) with a sample or a
    verify, on the lone-prefill graphs."""

    path, argmaxed = "prefill_graph", False

    def __init__(self, graphs: PrefillGraphs) -> None:
        self.graphs = graphs

    def supports(self, inputs: StepInputs) -> bool:
        if len(inputs.items) != 1:
            return False
        r, n = inputs.items[0]
        start, real = r.num_computed_tokens, n - len(r.draft_token_ids)
        return (
            1 < n <= self.graphs.max_tokens
            and start + real == r.num_tokens
            and not r.score_only
            and r.params.prompt_logprobs is None
            and r.token_at(start + real - 1) != PENDING
        )

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        r, _ = inputs.items[0]
        logits = self.graphs.run(inputs.tokens(0), r.num_computed_tokens, r.block_ids, r.state_slot,
                                 rows=len(r.draft_token_ids) + 1)
        return logits, self.graphs.last_hidden


class EagerExecutor:
    """Any step, by the model's forward over host-built metadata (`ForwardMeta.build`)."""

    path, argmaxed = "eager", False

    def __init__(self, model: Qwen3_5MoeModel, caches: CacheTensors, tok_buf: torch.Tensor, block_size: int,
                 max_blocks: int, device: torch.device) -> None:
        self.model, self.caches, self.tok_buf = model, caches, tok_buf
        self.block_size, self.max_blocks, self.device = block_size, max_blocks, device

    def supports(self, inputs: StepInputs) -> bool:
        return True

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor]:
        ids: list[int] = []
        positions: list[int] = []
        dst: list[tuple[int, int]] = []  # (row of ids, previous step's token-buffer row) per pending token
        for i, (req, n) in enumerate(inputs.items):
            start = req.num_computed_tokens
            src = inputs.source(i)
            if src >= 0:
                dst.append((len(ids) + n - len(req.draft_token_ids) - 1, src))
            ids.extend(inputs.tokens(i))
            positions.extend(range(start, start + n))
        items = inputs.items
        logits_rows = inputs.logits_rows()
        meta = ForwardMeta.build(
            query_lens=[n for _, n in items],
            context_lens=[r.num_computed_tokens for r, _ in items],
            block_tables=[r.block_ids for r, _ in items],
            state_slots=[r.state_slot for r, _ in items],
            block_size=self.block_size,
            logits_rows=logits_rows,
            device=self.device,
            # capacity-wide, as the warmup's and the graphs': a narrower table gives the kernels a row
            # stride the warmup did not compile (Triton specialises it on % 16)
            max_blocks=self.max_blocks,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        if dst:  # input_ids[d] = the previous step's token row s, on the device
            idx = torch.tensor(dst, dtype=torch.int64).to(self.device, non_blocking=True)  # [n, 2]
            input_ids[idx[:, 0]] = self.tok_buf[idx[:, 1]]
        pos = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        hidden = self.model(input_ids, pos, meta, self.caches)
        if not logits_rows:
            return None, hidden
        return self.model.compute_logits(hidden[meta.logits_indices]), hidden  # [R, V] fp32
