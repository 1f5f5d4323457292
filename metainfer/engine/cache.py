"""Cache bookkeeping on the host: paged KV blocks and DeltaNet state slots.

Both pools reserve id 0 as a null entry (CUDA-graph padding writes there); real requests get ids
1..N. Only ids move here; the runner owns the device tensors.
"""

from __future__ import annotations

from metainfer.engine.request import Request


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


class CacheManager:
    """Admission arithmetic for both cache kinds."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        self.block_size = block_size
        self.blocks = IdPool(num_blocks, "KV block")
        self.slots = IdPool(num_slots, "state slot")

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
        """Frees everything `req` holds; its cached progress is lost (recompute on resume)."""
        if req.block_ids:
            self.blocks.give(req.block_ids)
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
        }
