"""`path.prefix`: requests served from prefix-cache hits judged against the reference directly.

A conversation on fresh prompts (seeded from the suite's seed and the path's name), every request
greedy, its rows and tokens judged as `path_runs._judge` does (the reference teacher-forced along the
engine's own tokens, from the prompt's last position on):

0. pressure: the oracle allocates every free block and frees them (every cached block is evicted,
   whatever ran before);
1. turn 1: prompt P of 3 whole blocks (cold): its states are snapshot where it ends (a prefill
   chunk ends there; decode snapshots are not relied on: a speculative engine's verifies take none);
2. turn 2, one batch: P + turn 1's tokens + a 2-block message (a multi-turn hit), and a prompt that
   shares turn 1's sequence up to the middle of the block after P (a prefix ending mid-block: the
   hit stops at P's snapshot, the partly shared block is recomputed);
3. pressure: the oracle allocates free KV blocks (as a burst of other requests would) until
   allocation has evicted the last cached block of turn 2's multi-turn sequence, then frees them,
   and drops the snapshot at the end of the blocks left (if one is there);
4. turn 3: that sequence + its tokens + a new message: the hit restores a snapshot older than its
   cached blocks and recomputes the cached blocks beyond it.

Coverage: each turn-2 and turn-3 request started from a hit, and turn 3's hit is shorter than its
cached blocks (a snapshot older than the match).
"""

from __future__ import annotations

from metainfer.engine.prefix_cache import extend_hashes
from metainfer.oracle.compare import Check, Gates
from metainfer.oracle.engine_runs import greedy_batch
from metainfer.oracle.path_runs import _gen, _ids, _judge, _Run, _window
from metainfer.oracle.suites import Suite

MESSAGE = 7  # tokens of a new message
LATER_GEN = 4  # greedy tokens per request


def _hashes(cache, seq: list[int]) -> list[int]:
    hashes: list[int] = []
    extend_hashes(hashes, len(seq) // cache.block_size, cache.block_size, seq.__getitem__)
    return hashes


def _cached_blocks(cache, seq: list[int]) -> int:
    """How many of seq's leading full blocks the cache indexes now (`CacheManager.match`'s walk)."""
    hashes = _hashes(cache, seq)
    n = 0
    while n < len(hashes) and cache.blocks.lookup(hashes[n]) is not None:
        n += 1
    return n


def _evict_to_older_snapshot(cache, seq: list[int]) -> tuple[int, int]:
    """Free KV blocks are allocated (evicting cached ones, least recently freed first, as a burst of
    other requests would) until seq's last cached block is evicted, then freed; the snapshot at the
    end of seq's cached blocks left, if any, is dropped (as the snapshot pool's LRU eviction would:
    taking slots until it goes would evict the older snapshots first).
    -> (blocks taken, snapshots dropped)."""
    hashes = _hashes(cache, seq)
    n = _cached_blocks(cache, seq)
    blocks: list[int] = []
    while n and cache.blocks.lookup(hashes[n - 1]) is not None and cache.blocks.num_free:
        blocks += cache.blocks.take(1)
    cache.blocks.give(blocks)
    n = _cached_blocks(cache, seq)
    slot = cache.snapshots.lookup(hashes[n - 1]) if n else None
    if slot is not None:
        cache.snapshots.drop(slot, hashes[n - 1])
    return len(blocks), int(slot is not None)


def prefix_path(llm, reference, suite: Suite, g: Gates) -> tuple[list[Check], dict]:
    eng = llm.engine
    cache = eng.cache
    bs, vocab = cache.block_size, eng.model_config.vocab_size
    first = 3 * bs
    need = first + 3 * LATER_GEN + 2 * bs + MESSAGE + 1
    if not cache.prefix_caching or need > eng.max_model_len:
        why = "prefix caching is off" if not cache.prefix_caching else f"needs max_model_len >= {need}"
        return [Check("path.prefix.coverage", None, ">= 4", False, why)], {"coverage": {}}
    gen = _gen(suite, "prefix")
    runs: list[tuple[_Run, list]] = []  # (run, each request's Request)

    def drive(prompts: list[list[int]], gen_n: int) -> _Run:
        run, reqs = _drive_requests(llm, prompts, gen_n)
        runs.append((run, reqs))
        return run

    with _window(llm) as cov:
        cache.blocks.give(cache.blocks.take(cache.blocks.num_free))  # (0.) a clean start
        p1 = _ids(first, vocab, gen)
        s1 = p1 + drive([p1], LATER_GEN).tokens[0]
        # the multi-turn message spans 2 blocks: turn 2's cached blocks reach one past the next boundary
        t2 = [s1 + _ids(2 * bs, vocab, gen), s1[: first + bs // 2] + _ids(MESSAGE, vocab, gen)]
        s2 = t2[0] + drive(t2, LATER_GEN).tokens[0]
        cached_before = _cached_blocks(cache, s2) * bs
        evicted_for = _evict_to_older_snapshot(cache, s2)
        matched = _cached_blocks(cache, s2) * bs
        drive([s2 + _ids(MESSAGE, vocab, gen)], LATER_GEN)
    merged = _Run([], [], [], [])
    hits: list[int] = []
    for run, reqs in runs:
        merged.prompts += run.prompts
        merged.tokens += run.tokens
        merged.rows += run.rows
        merged.preempted_at += run.preempted_at
        merged.problems += run.problems
        hits += [getattr(r, "num_cached_tokens", 0) for r in reqs]
    older = 0 < hits[3] < matched
    fig = {"prompt_lens": [len(p) for p in merged.prompts], "cached_tokens": hits,
           "turn3_cached_tokens": [cached_before, matched], "taken_to_evict": evicted_for}  # fmt: skip
    reached = (
        float(sum(h > 0 for h in hits[1:]) + older) if hits[0] == 0 else 0.0,
        4,
        f"turn 2-3 requests served from a hit (cached tokens per request {hits}) + turn 3 on a snapshot "
        f"older than its {matched} cached tokens (after an eviction from {cached_before})",
    )
    return _judge("prefix", reference, merged, g, cov, reached, fig)


def _drive_requests(llm, prompts: list[list[int]], gen_n: int) -> tuple[_Run, list]:
    """`path_runs._drive`, also returning each prompt's Request (its cached-token count)."""
    preempted_at: list[dict[int, int]] = [{} for _ in prompts]
    reqs: list = [None] * len(prompts)

    def on_row(i, req, pos):
        preempted_at[i][pos] = req.num_preemptions
        reqs[i] = req

    g = greedy_batch(llm, prompts, gen_n, on_row=on_row)
    return _Run(g.prompts, g.tokens, g.rows, preempted_at, g.problems), reqs
