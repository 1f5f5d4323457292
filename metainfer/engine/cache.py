"""Cache bookkeeping on the host: paged KV blocks, DeltaNet state slots, and (with prefix caching)
the index of cached blocks and state snapshots (`prefix_cache`).

Both pools reserve id 0 as a null entry (CUDA-graph padding writes there); real requests get ids
1..N. Snapshot slots follow the running slots: num_slots + 1 .. num_slots + num_snapshots. Only ids
move here; the runner owns the device tensors and performs the state copies a step lists
(`StateCopies`).
"""

from __future__ import annotations

from dataclasses import dataclass

from metainfer.engine.prefix_cache import BlockPool, SnapshotPool, extend_hashes
from metainfer.engine.request import Request

PENDING = -1  # a token id not on the host yet (engine.executors.PENDING)


class IdPool:
    """A free list of ids 1..n. LIFO reuse keeps recently used memory warm."""

    def __init__(self, n: int, what: str) -> None:
        if n <= 0:
            raise ValueError(f"need at least one {what}")
        self.capacity = n
        self.what = what
        self._free = list(range(n, 0, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def take(self, k: int = 1) -> list[int]:
        if k > len(self._free):
            raise RuntimeError(f"out of {self.what}s: asked {k}, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(k)]
        self._used.update(ids)
        return ids

    def give(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise RuntimeError(f"{self.what} {i} freed twice or never taken")
            self._used.remove(i)
            self._free.append(i)


def _known(req: Request) -> int:
    """How many of req's tokens are on the host (only its last tokens can be pending)."""
    known = req.num_tokens
    while known > 0 and req.token_at(known - 1) == PENDING:
        known -= 1
    return known


@dataclass(frozen=True)
class PrefixHit:
    """A waiting request's cached prefix: `num_tokens` (block-aligned) tokens whose KV is in
    `block_ids` and whose DeltaNet states are in snapshot slot `snapshot`."""

    num_tokens: int
    block_ids: list[int]
    snapshot: int


@dataclass
class StateCopies:
    """A step's state-slot copies (src, dst): `restores` before its forward (snapshot -> a hit
    request's slot), `saves` after it (a request's slot -> a new snapshot)."""

    restores: list[tuple[int, int]]
    saves: list[tuple[int, int]]


class CacheManager:
    """Admission arithmetic for both cache kinds, and the prefix cache's index when
    `snapshot_interval` > 0 (prefix caching on): full blocks are indexed once their KV is final
    (`commit`), a request's states are snapshot at block-aligned chunk ends (`plan_snapshot`), and
    an admitted request starts from its longest cached prefix (`match`, `admit`)."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, num_snapshots: int = 0,
                 snapshot_interval: int = 0) -> None:
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks)
        self.slots = IdPool(num_slots, "state slot")
        self.prefix_caching = snapshot_interval > 0 and num_snapshots > 0
        self.snapshot_interval = snapshot_interval
        self.snapshots = SnapshotPool(num_slots + 1, num_snapshots) if self.prefix_caching else None
        # prefix caching counters: prompt tokens looked up / served from the cache, hit requests
        self.stats = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_hit_requests": 0}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids))

    def can_grow(self, req: Request, num_new_tokens: int) -> bool:
        return self.new_blocks_needed(req, num_new_tokens) <= self.blocks.num_free

    def grow(self, req: Request, num_new_tokens: int) -> None:
        """Gives `req` the blocks to cache `num_new_tokens` more tokens (caller checked can_grow)."""
        n = self.new_blocks_needed(req, num_new_tokens)
        if n:
            req.block_ids.extend(self.blocks.take(n))

    def assign_slot(self, req: Request) -> None:
        assert req.state_slot is None
        req.state_slot = self.slots.take(1)[0]

    def release(self, req: Request) -> None:
        """Frees everything `req` holds; its cached progress is lost (recompute on resume). With
        prefix caching its final full blocks and snapshots are indexed first (they stay cached)."""
        if self.prefix_caching:
            if req.error is None:
                self.commit(req)
            for _, slot, _, _ in req.pending_snapshots:  # (their blocks never became final)
                self.snapshots.give(slot)
            req.pending_snapshots = []
            req.num_cached_blocks = 0
        if req.block_ids:
            self.blocks.give(req.block_ids[::-1])  # the tail first: evicted before the prefix
            req.block_ids = []
        if req.state_slot is not None:
            self.slots.give([req.state_slot])
            req.state_slot = None
        req.num_computed_tokens = 0

    def usage(self) -> dict[str, float]:
        return {
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_total": self.blocks.capacity,
            "state_slots_used": self.slots.num_used,
            "state_slots_total": self.slots.capacity,
            "kv_blocks_cached": self.blocks.num_cached,
            "snapshots_cached": self.snapshots.num_keyed if self.snapshots else 0,
            "snapshots_total": self.snapshots.capacity if self.snapshots else 0,
            **self.stats,
        }

    # ---- prefix caching -----------------------------------------------------------------------
    def _hashes(self, req: Request, n_blocks: int) -> list[int]:
        """The chain hashes of req's first n_blocks full blocks (their tokens on the host)."""
        extend_hashes(req.block_hashes, n_blocks, self.block_size, req.token_at)
        return req.block_hashes

    def commit(self, req: Request) -> None:
        """Indexes req's blocks whose KV is final (below num_computed_tokens, tokens on the host)
        and keys its snapshots taken at their ends. Called before each step for every running
        request (the previous step's launch wrote their KV, in stream order) and on release."""
        if not self.prefix_caching:
            return
        full = min(req.num_computed_tokens, _known(req)) // self.block_size
        full = min(full, len(req.block_ids))
        if full > req.num_cached_blocks:
            hashes = self._hashes(req, full)
            for i in range(req.num_cached_blocks, full):
                self.blocks.register(req.block_ids[i], hashes[i])
            req.num_cached_blocks = full
        if not req.pending_snapshots:
            return
        done = full * self.block_size
        keep = []
        for pos, slot, permanent, drafts in req.pending_snapshots:
            if pos > done:
                keep.append((pos, slot, permanent, drafts))
                continue
            if drafts and tuple(req.tokens_slice(pos - len(drafts), pos)) != drafts:
                self.snapshots.give(slot)  # taken after a verify that rejected a draft: not these tokens'
                continue
            h = req.block_hashes[pos // self.block_size - 1]
            if self.snapshots.key(slot, h) and not permanent:  # a request keeps its latest such snapshot
                if req.moving_snapshot is not None:
                    self.snapshots.drop(*req.moving_snapshot)
                req.moving_snapshot = (slot, h)
        req.pending_snapshots = keep

    def plan_snapshot(self, req: Request, num_new_tokens: int) -> int | None:
        """A snapshot slot for req's states after a chunk of num_new_tokens (with its drafts, if a
        verify) that ends on a block boundary (the caller copies the slot after the step's forward),
        or None. A verify's snapshot is keyed only if the drafts became the sequence's tokens (a
        rejection rolls the states back: the snapshot holds the drafts' states). Snapshots inside
        the prompt and at multiples of `snapshot_interval` stay; a later one (decode) replaces the
        request's previous such snapshot once keyed. None for scoring requests."""
        if not self.prefix_caching or req.state_slot is None or req.score_only:
            return None
        end = req.num_computed_tokens + num_new_tokens
        if end % self.block_size or end <= req.num_cached_blocks * self.block_size:
            return None
        permanent = end <= req.num_prompt_tokens or end % self.snapshot_interval == 0
        drafts = tuple(req.draft_token_ids)  # a verify's snapshot is kept only if they all are accepted
        slot = None
        if (not permanent and not drafts and req.moving_snapshot is not None
                and self.snapshots.reclaim(*req.moving_snapshot)):
            slot = req.moving_snapshot[0]  # overwritten in place: no hit can find it from now on
            req.moving_snapshot = None
        if slot is None:
            slot = self.snapshots.take()
        if slot is None:
            return None
        req.pending_snapshots.append((end, slot, permanent, drafts))
        return slot

    def chunk_end(self, req: Request, start: int, end: int) -> int:
        """Where a chunk [start, end) that starts inside a generating request's prompt stops: at the
        first snapshot checkpoint inside it (a multiple of `snapshot_interval`, or for a sequence of
        at least that many tokens its last block boundary), else at `end`. Scoring requests take no
        snapshots: their chunks are not cut."""
        if not self.prefix_caching or end - start <= 1 or start >= req.num_prompt_tokens or req.score_only:
            return end
        n = self.snapshot_interval
        cut = min(end, (start // n + 1) * n)
        last = req.num_tokens // self.block_size * self.block_size
        if req.num_tokens >= n and start < last < cut:
            cut = last
        return cut

    def match(self, req: Request) -> PrefixHit | None:
        """req's longest cached prefix that ends on a snapshot (its last token is always left to
        compute: its logits are needed). None without one, or for a request that needs every
        prompt position's logits (scoring, prompt logprobs), or one that holds cache already."""
        if (not self.prefix_caching or req.score_only or req.params.prompt_logprobs is not None
                or req.num_computed_tokens or req.block_ids):
            return None
        n = (min(req.num_tokens - 1, _known(req))) // self.block_size
        hashes = self._hashes(req, n)
        blocks: list[int] = []
        for h in hashes[:n]:
            b = self.blocks.lookup(h)
            if b is None:
                break
            blocks.append(b)
        for k in range(len(blocks), 0, -1):
            slot = self.snapshots.lookup(hashes[k - 1])
            if slot is not None:
                return PrefixHit(k * self.block_size, blocks[:k], slot)
        return None

    def can_admit(self, req: Request, hit: PrefixHit | None, num_new_tokens: int) -> bool:
        """Whether the blocks for req's first chunk (after `hit`'s tokens) fit."""
        if hit is None:
            return self.can_grow(req, num_new_tokens)
        need = self.blocks_for(hit.num_tokens + num_new_tokens) - len(hit.block_ids)
        return need <= self.blocks.num_free - self.blocks.num_unheld(hit.block_ids)

    def admit(self, req: Request, hit: PrefixHit | None, copies: StateCopies) -> None:
        """Counts the lookup; on a hit req shares the prefix's blocks, starts after it, and its
        slot gets the snapshot (a restore before the step's forward). req holds a slot, no blocks."""
        req.num_cached_tokens = 0
        if not self.prefix_caching or req.score_only or req.params.prompt_logprobs is not None:
            return
        self.stats["prefix_cache_queries"] += req.num_tokens
        if hit is None:
            return
        self.blocks.share(hit.block_ids)
        req.block_ids = list(hit.block_ids)
        req.num_cached_blocks = len(hit.block_ids)
        req.num_computed_tokens = hit.num_tokens
        req.num_cached_tokens = hit.num_tokens
        self.snapshots.touch(hit.snapshot)
        copies.restores.append((hit.snapshot, req.state_slot))
        self.stats["prefix_cache_hits"] += hit.num_tokens
        self.stats["prefix_cache_hit_requests"] += 1
