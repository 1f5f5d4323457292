"""Continuous batching: FCFS, chunked prefill under a token budget, decodes and prefills in one
step, preemption by recompute when KV blocks run out, prefix caching (a waiting request starts
after its longest cached prefix; prompt chunks stop at snapshot checkpoints: `CacheManager`).
Host state only."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from metainfer.engine.cache import CacheManager, StateCopies
from metainfer.engine.request import Request, Status


@dataclass
class ScheduledBatch:
    """One step's work: (request, number of new tokens) in scheduling order, and the state-slot
    copies around its forward (prefix caching)."""

    items: list[tuple[Request, int]]
    preempted: list[Request]
    copies: StateCopies = field(default_factory=lambda: StateCopies([], []))

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __len__(self) -> int:
        return len(self.items)


Drafter = Callable[[Request, int], list[int]]  # (request, at most k) -> draft tokens, maybe none


class Scheduler:
    def __init__(
        self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
        drafter: Drafter | None = None, draft_kv: bool = False,
    ) -> None:
        self.cache = cache
        self.drafter = drafter  # speculative decoding: drafts appended to a chunk that ends the sequence
        # the drafter writes KV at the draft positions (MTP): their blocks grown before it drafts
        self.draft_kv = draft_kv
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.num_preemptions = 0

    # ---- queue --------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Takes a request out (finished or aborted) and frees its cache."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.release(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.token_budget
        items: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        scheduled: set[str] = set()
        copies = StateCopies([], [])
        for req in self.running:  # the blocks and snapshots the previous steps made final
            self.cache.commit(req)

        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != Status.RUNNING:  # preempted earlier in this loop
                continue
            start = req.num_computed_tokens
            n = self.cache.chunk_end(req, start, start + min(req.num_tokens - start, budget)) - start
            req.draft_token_ids = []
            if n <= 0 or self._done_pending(req):
                continue
            drafts = self._drafts(req, n, budget)
            if drafts and not self.cache.can_grow(req, n + len(drafts)):  # no blocks for them: none
                drafts = []
            req.draft_token_ids = drafts
            n += len(drafts)
            while not self.cache.can_grow(req, n):
                victim = self.running[-1]
                if victim.request_id in scheduled:  # never undo work already scheduled
                    victim = req
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                continue
            self.cache.grow(req, n)
            self._snapshot(req, n, copies)
            items.append((req, n))
            scheduled.add(req.request_id)
            budget -= n

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if self.cache.slots.num_free == 0:
                    break
                hit = self.cache.match(req)
                start = hit.num_tokens if hit is not None else req.num_computed_tokens
                n = self.cache.chunk_end(req, start, start + min(req.num_tokens - start, budget)) - start
                if not self.cache.can_admit(req, hit, n):
                    break
                self.waiting.popleft()
                self.cache.assign_slot(req)
                self.cache.admit(req, hit, copies)
                self.cache.grow(req, n)
                self._snapshot(req, n, copies)
                req.status = Status.RUNNING
                self.running.append(req)
                items.append((req, n))
                scheduled.add(req.request_id)
                budget -= n
        return ScheduledBatch(items, preempted, copies)

    def _snapshot(self, req: Request, n: int, copies: StateCopies) -> None:
        """A snapshot of req's states after its chunk of n tokens (drafts included), where one is due."""
        slot = self.cache.plan_snapshot(req, n)
        if slot is not None:
            copies.saves.append((req.state_slot, slot))

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """Speculative drafts for a chunk of n tokens that ends the sequence (a decode, or the
        recompute after a rejection), within the step budget and the request's remaining tokens
        (a verify emits up to one token more than it drafts)."""
        if self.drafter is None or req.num_computed_tokens + n != req.num_tokens or not req.output_token_ids:
            return []
        k = min(budget - n, req.max_tokens - len(req.output_token_ids) - 1)
        if k <= 0:
            return []
        if self.draft_kv:  # the blocks the drafter writes in, before it does
            if not self.cache.can_grow(req, n + k):
                return []
            self.cache.grow(req, n + k)
        return self.drafter(req, k)[:k]

    def _done_pending(self, req: Request) -> bool:
        """Its last scheduled step already produces its final token (the result is in flight)."""
        n_out = len(req.output_token_ids)
        return n_out > 0 and (n_out >= req.max_tokens or req.num_tokens >= self.max_model_len)

    def _preempt(self, req: Request) -> None:
        req.draft_token_ids = []
        self.running.remove(req)
        self.cache.release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
