"""Driving the engine under test: the mixed greedy batch, prompts alone, seeded sampling, scoring.

Only the engine's public surface is used: `LLMEngine.add_request` / `step`, `LLM.generate` /
`score`, and the runner's `logits_hook` seam, which hands over every logits row the engine
computes (decode rows are compared with the reference position by position).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from metainfer.engine.request import Request, SamplingParams
from metainfer.llm import LLM


@dataclass
class GreedyRun:
    """Greedy continuations of a batch, and the logits each was sampled from."""

    prompts: list[list[int]]
    tokens: list[list[int]]  # continuation per prompt
    rows: list[dict[int, torch.Tensor]]  # per prompt: position -> logits [V] predicting position + 1
    problems: list[str] = field(default_factory=list)
    steps: int = 0

    def decode_rows(self, i: int) -> tuple[torch.Tensor | None, int]:
        """[n, V] rows at positions L-1 .. L+n-2 (n = first gap in what the hook delivered)."""
        L, got = len(self.prompts[i]), self.rows[i]
        out = []
        for j in range(len(self.tokens[i])):
            row = got.get(L - 1 + j)
            if row is None:
                break
            out.append(row)
        return (torch.stack(out) if out else None), len(out)


@contextmanager
def capture_rows(
    llm: LLM,
    want: dict[str, int],
    keep: Callable[[Request], bool] | None = None,
    on_row: Callable[[int, Request, int], None] | None = None,
):
    """Routes the engine's sampled-row logits of the requests in `want` (id -> index) into a list of
    per-request {position: row} dicts (rows cloned: CUDA-graph outputs are reused buffers); the
    latest row of a position wins. `keep(request)`: whether to keep a row (default all); `on_row(i,
    request, position)`: told of every sampled row, kept or not."""
    runner = llm.engine.runner
    store: list[dict[int, torch.Tensor]] = [dict() for _ in range(max(want.values(), default=-1) + 1)]
    prev = runner.logits_hook

    def hook(owners, logits):
        if prev is not None:
            prev(owners, logits)
        for k, (req, kind, pos) in enumerate(owners):
            i = want.get(req.request_id)
            # speculative verify rows too: a row after a rejected draft is overwritten by the row
            # of that position once its token is real, and positions past the end are never read
            if i is not None and kind in ("sample", "verify"):
                if on_row is not None:
                    on_row(i, req, pos)
                if keep is None or keep(req):
                    store[i][pos] = logits[k].detach().clone()

    runner.logits_hook = hook
    try:
        yield store
    finally:
        runner.logits_hook = prev


def greedy_batch(
    llm: LLM,
    prompts: Sequence[Sequence[int]],
    gen_tokens: int,
    late_from: int | None = None,
    late_after_steps: int = 0,
    keep: Callable[[Request], bool] | None = None,
    on_row: Callable[[int, Request, int], None] | None = None,
) -> GreedyRun:
    """Greedy, ignore_eos, `gen_tokens` each, as one continuous batch; prompts[late_from:] are added
    after `late_after_steps` steps (or when the engine runs dry), so they join a running batch.
    `keep`, `on_row`: as `capture_rows`'."""
    eng = llm.engine
    late_from = len(prompts) if late_from is None else late_from
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    ids: list[str] = [eng.new_request_id() for _ in prompts]
    index = {rid: i for i, rid in enumerate(ids)}
    final: dict[str, object] = {}
    run = GreedyRun([list(p) for p in prompts], [[] for _ in prompts], [])
    with capture_rows(llm, index, keep, on_row) as store:
        for i in range(late_from):
            eng.add_request(list(prompts[i]), params, request_id=ids[i])
        added = late_from
        while len(final) < len(prompts):
            if added < len(prompts) and (run.steps >= late_after_steps or not eng.has_unfinished()):
                for i in range(added, len(prompts)):
                    eng.add_request(list(prompts[i]), params, request_id=ids[i])
                added = len(prompts)
            if not eng.has_unfinished():
                run.problems.append(f"engine idle with {len(prompts) - len(final)} requests unfinished")
                break
            for out in eng.step():
                if out.finished and out.request_id in index:
                    final[out.request_id] = out
            run.steps += 1
    run.rows = store
    for i, rid in enumerate(ids):
        out = final.get(rid)
        if out is None:
            continue
        run.tokens[i] = list(out.token_ids)
        if out.error or len(out.token_ids) != gen_tokens:
            run.problems.append(
                f"prompt {i}: {len(out.token_ids)} of {gen_tokens} tokens, finish_reason={out.finish_reason}"
                + (f", error: {out.error}" if out.error else "")
            )
    return run


@dataclass(frozen=True)
class SampleRun:
    tokens: tuple[tuple[int, ...], ...]  # per request


def sample_batch(llm: LLM, requests: Sequence[tuple[Sequence[int], int]], n: int) -> SampleRun:
    """(prompt, seed) per request, temperature 1, `n` tokens each, one batch."""
    params = [
        SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True, detokenize=False)
        for _, s in requests
    ]
    outs = llm.generate(prompt_token_ids=[list(p) for p, _ in requests], sampling_params=params)
    return SampleRun(tuple(tuple(o.token_ids) for o in outs))


def score_batch(llm: LLM, seqs: Sequence[Sequence[int]]) -> list[torch.Tensor | None]:
    """Teacher-forced logits [len, V] per sequence, all in one continuous batch."""
    return list(llm.score([list(s) for s in seqs]))
