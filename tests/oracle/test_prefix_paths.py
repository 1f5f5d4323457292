"""`path.prefix` (metainfer.oracle.prefix_paths): requests served from prefix-cache hits judged
against the reference, and mutants only it catches: snapshots never restored (a hit runs on the
slot's stale states) and a hit that shares one block too many (KV past the snapshot)."""

from __future__ import annotations

import pytest

from metainfer.engine.cache import CacheManager, PrefixHit
from metainfer.oracle.compare import GATES
from metainfer.oracle.prefix_paths import prefix_path

pytest.importorskip("transformers")


def _run(setup) -> tuple[dict, dict]:
    checks, figures = prefix_path(setup.llm, setup.reference, setup.suite, GATES[setup.precision])
    for c in checks:
        if not c.passed:
            fig = "n/a" if c.figure is None else f"{c.figure:.4g}"
            print(f"  {c.name}: {fig} vs gate {c.gate} ({c.detail[:200]})")
    return {c.name: c for c in checks}, figures


def test_honest_engine_passes_the_prefix_path(tiny):
    checks, fig = _run(tiny)
    assert all(c.passed for c in checks.values()), fig
    hits = fig["cached_tokens"]
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])
    before, after = fig["turn3_cached_tokens"]  # turn 3's cached tokens before and after the eviction
    assert hits[3] < after < before
    assert tiny.llm.engine.cache.blocks.num_used == 0


def test_restore_skipped_fails(tiny, monkeypatch):
    runner = tiny.llm.engine.runner
    monkeypatch.setattr(runner, "launch", _without_restores(runner.launch))
    checks, _ = _run(tiny)
    assert not checks["path.prefix.logits"].passed or not checks["path.prefix.tokens"].passed


def test_one_block_too_many_fails(tiny, monkeypatch):
    """The hit starts a block past its snapshot: that block's tokens never reach the DeltaNet states."""
    match = CacheManager.match

    def greedy_match(self, req):
        hit = match(self, req)
        if hit is None or (req.num_tokens - 1) // self.block_size <= len(hit.block_ids):
            return hit
        bid = self.blocks.lookup(self._hashes(req, len(hit.block_ids) + 1)[len(hit.block_ids)])
        if bid is None:
            return hit
        return PrefixHit(hit.num_tokens + self.block_size, [*hit.block_ids, bid], hit.snapshot)

    monkeypatch.setattr(CacheManager, "match", greedy_match)
    checks, _ = _run(tiny)
    assert not checks["path.prefix.logits"].passed or not checks["path.prefix.tokens"].passed


def _without_restores(launch):
    def run(batch):
        batch.copies.restores.clear()
        return launch(batch)

    return run
