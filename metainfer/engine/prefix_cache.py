"""Prefix caching on the host: hash-chained full KV blocks and DeltaNet state snapshots.

A full block (block_size tokens) is named by a chain hash: hash((parent's hash, its token ids)),
block 0's parent being ROOT_HASH, so equal hashes mean equal prefixes. Blocks are ref-counted: a
request holds each of its blocks once, and a cached block may be held by several requests (only
full blocks whose KV is final are ever shared, so no request writes into a shared block). A block
no request holds goes back to the pool; if it is indexed by a hash it stays readable there
(evictable, least recently freed first) until an allocation needs it.

The DeltaNet layers' conv and recurrent states cannot be cut at an arbitrary position, so a
sequence's states are copied at block-aligned positions into snapshot slots (extra rows of the
runner's state tensors) named by the hash of the block that ends there. A hit restores the latest
snapshot whose prefix blocks are all cached and recomputes from there. Only ids move here; the
runner owns the device tensors and does the copies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

ROOT_HASH = hash(("metainfer.prefix_cache", 0))  # parent of a sequence's first block


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The hash of a full block with these token ids after the prefix whose hash is `parent`."""
    return hash((parent, tokens))


def extend_hashes(hashes: list[int], n_blocks: int, block_size: int, token_at: Callable[[int], int]) -> None:
    """Extends `hashes` (the chain hashes of a sequence's first len(hashes) blocks) in place to
    n_blocks blocks; token_at(i) gives the sequence's i-th token id."""
    for b in range(len(hashes), n_blocks):
        parent = hashes[-1] if hashes else ROOT_HASH
        toks = tuple(token_at(i) for i in range(b * block_size, (b + 1) * block_size))
        hashes.append(chain_hash(parent, toks))


class BlockPool:
    """KV block ids 1..n (0 is the null block) with reference counts and a hash index.

    States of a block: held (ref > 0), free (ref 0, not indexed: LIFO reuse), or cached (ref 0,
    indexed: LRU order, evicted by `take` only when no free block is left). `num_free` counts free
    and cached blocks: both can be handed out."""

    def __init__(self, n: int, what: str = "KV block") -> None:
        if n <= 0:
            raise ValueError(f"need at least one {what}")
        self.capacity = n
        self.what = what
        self._ref = [0] * (n + 1)
        self._free = list(range(n, 0, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, oldest first
        self._hash_of: dict[int, int] = {}
        self._by_hash: dict[int, int] = {}
        self.num_used = 0
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks indexed by a hash, held or not."""
        return len(self._hash_of)

    def ref(self, block: int) -> int:
        return self._ref[block]

    def take(self, k: int = 1) -> list[int]:
        if k > self.num_free:
            raise RuntimeError(f"out of {self.what}s: asked {k}, {self.num_free} free")
        ids = []
        for _ in range(k):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
                self.num_evicted += 1
            self._ref[b] = 1
            ids.append(b)
        self.num_used += k
        return ids

    def give(self, ids: list[int]) -> None:
        for b in ids:
            if self._ref[b] <= 0:
                raise RuntimeError(f"{self.what} {b} freed twice or never taken")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self.num_used -= 1
                if b in self._hash_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def share(self, ids: list[int]) -> None:
        """One more holder for each of these indexed blocks (a prefix hit)."""
        for b in ids:
            if self._ref[b] == 0:
                del self._lru[b]
                self.num_used += 1
            self._ref[b] += 1

    def lookup(self, h: int) -> int | None:
        return self._by_hash.get(h)

    def num_unheld(self, ids: list[int]) -> int:
        """How many of these blocks no request holds (sharing them takes them out of `num_free`)."""
        return sum(self._ref[b] == 0 for b in ids)

    def register(self, block: int, h: int) -> None:
        """Indexes a held block whose KV is final under its chain hash. A hash already indexed keeps
        its block (this one stays a private copy); a block is indexed once."""
        if h in self._by_hash or block in self._hash_of:
            return
        self._by_hash[h] = block
        self._hash_of[block] = h


class SnapshotPool:
    """State slots [first, first + n) that hold DeltaNet state snapshots.

    A slot is free, owned (taken for a snapshot whose copy is launched but whose block hash is not
    known yet: `key` or `give` it), or keyed (indexed by the hash of the block ending where it was
    taken; LRU, evicted by `take` when no slot is free)."""

    def __init__(self, first: int, n: int) -> None:
        self.capacity = n
        self._free = list(range(first + n - 1, first - 1, -1))
        self._lru: OrderedDict[int, int] = OrderedDict()  # keyed slot -> hash, least recently used first
        self._by_hash: dict[int, int] = {}
        self.num_evicted = 0

    @property
    def num_keyed(self) -> int:
        return len(self._lru)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """A slot for a new snapshot (the least recently used keyed one if none is free), or None
        when every slot is owned."""
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        slot, h = self._lru.popitem(last=False)
        del self._by_hash[h]
        self.num_evicted += 1
        return slot

    def give(self, slot: int) -> None:
        """An owned slot back, unkeyed."""
        self._free.append(slot)

    def key(self, slot: int, h: int) -> bool:
        """Indexes an owned slot under `h`; if `h` already has a snapshot, the slot is freed. -> keyed."""
        if h in self._by_hash:
            self._free.append(slot)
            return False
        self._by_hash[h] = slot
        self._lru[slot] = h
        return True

    def drop(self, slot: int, h: int) -> None:
        """Frees a keyed slot if it still holds the snapshot of `h` (it may have been evicted)."""
        if self._by_hash.get(h) == slot:
            del self._by_hash[h]
            del self._lru[slot]
            self._free.append(slot)

    def reclaim(self, slot: int, h: int) -> bool:
        """Takes a keyed slot back as owned (unkeyed) if it still holds the snapshot of `h`."""
        if self._by_hash.get(h) != slot:
            return False
        del self._by_hash[h]
        del self._lru[slot]
        return True

    def lookup(self, h: int) -> int | None:
        return self._by_hash.get(h)

    def touch(self, slot: int) -> None:
        self._lru.move_to_end(slot)
