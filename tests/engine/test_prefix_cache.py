"""Prefix caching (engine.cache, engine.prefix_cache): the hash chain, the block and snapshot pools,
and the engine served from cache hits giving the same greedy tokens as cold (multi-turn, a prefix
that ends mid-block, a snapshot older than the match, eviction under pressure, preemption with
shared blocks, speculative decoding), with every block and slot back in the pools afterwards."""

from __future__ import annotations

import random

import pytest

from metainfer.config import EngineConfig
from metainfer.engine.prefix_cache import ROOT_HASH, BlockPool, SnapshotPool, chain_hash, extend_hashes
from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM

B = 16  # the default block size
VOCAB = 4000  # below the default model's special ids


# ---- units ---------------------------------------------------------------------------------------
def test_hash_chain_names_the_whole_prefix():
    a = list(range(40))
    b = a[:16] + [999] + a[17:]  # differs in block 1
    ha, hb = [], []
    extend_hashes(ha, 2, B, a.__getitem__)
    extend_hashes(hb, 2, B, b.__getitem__)
    assert ha[0] == hb[0] == chain_hash(ROOT_HASH, tuple(a[:16])) and ha[1] != hb[1]
    c = b[:16] + a[16:32]  # block 1 equal to a's again: same hashes as a
    hc = []
    extend_hashes(hc, 1, B, c.__getitem__)
    extend_hashes(hc, 2, B, c.__getitem__)  # incremental
    assert hc == ha
    # equal tokens after a different parent: a different hash
    assert chain_hash(ha[0], tuple(a[16:32])) != chain_hash(ROOT_HASH, tuple(a[16:32]))


def test_block_pool_refcounts_and_lru():
    p = BlockPool(4)
    x = p.take(3)
    for i, b in enumerate(x):
        p.register(b, 100 + i)
    p.share(x[:2])  # a second holder of the first two
    assert [p.ref(b) for b in x] == [2, 2, 1] and p.num_used == 3
    p.give(x[::-1])
    assert [p.ref(b) for b in x] == [1, 1, 0] and p.num_free == 2 and p.lookup(102) == x[2]
    p.give(x[1::-1])
    assert p.num_used == 0 and p.num_free == 4 and p.num_cached == 3
    assert p.take(1) != x  # the never-indexed block goes first
    y = p.take(1)[0]  # then the least recently freed cached one: x[2] (freed first)
    assert y == x[2] and p.lookup(102) is None and p.num_evicted == 1
    p.share([x[0]])  # a hit takes a cached block out of the free count
    assert p.num_free == 1 and p.ref(x[0]) == 1
    with pytest.raises(RuntimeError, match="out of"):
        p.take(2)
    p.register(y, 100)  # hash 100 is x[0]'s: y stays private
    assert p.lookup(100) == x[0]
    with pytest.raises(RuntimeError, match="freed twice"):
        p.give([x[1]])


def test_snapshot_pool_lru_and_ownership():
    s = SnapshotPool(first=5, n=2)
    a, b = s.take(), s.take()
    assert {a, b} == {5, 6} and s.take() is None  # both owned: nothing to evict
    assert s.key(a, 1) and s.key(b, 2)
    s.touch(a)
    c = s.take()  # evicts the least recently used: b
    assert c == b and s.lookup(2) is None and s.lookup(1) == a
    assert not s.key(c, 1)  # hash 1 has a snapshot: c is freed
    assert s.num_free == 1 and s.num_keyed == 1
    s.drop(a, 99)  # not a's hash: kept
    assert s.lookup(1) == a
    assert not s.reclaim(a, 99) and s.reclaim(a, 1)  # owned again, unkeyed
    assert s.lookup(1) is None and s.num_keyed == 0
    assert s.key(a, 1)
    s.drop(a, 1)
    assert s.num_free == 2 and s.num_keyed == 0


def test_config_validates_interval():
    assert EngineConfig(prefix_snapshot_interval=40).snapshot_interval == 48  # whole blocks
    assert EngineConfig(max_num_batched_tokens=1000).snapshot_interval == 1008  # default: the step budget
    with pytest.raises(ValueError, match="prefix_snapshot_interval"):
        EngineConfig(prefix_snapshot_interval=0)
    with pytest.raises(ValueError, match="num_snapshot_slots"):
        EngineConfig(num_snapshot_slots=-1)


# ---- the engine ----------------------------------------------------------------------------------
def _ids(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(VOCAB) for _ in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)


def _run(llm: LLM, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_greedy(n))
    assert all(o.error is None for o in outs)
    return [list(o.token_ids) for o in outs]


def _llm(**kw) -> LLM:
    kw = {"device": "cpu", "max_model_len": 512, "max_num_batched_tokens": 64, "prefix_snapshot_interval": 32,
          **kw}
    return LLM(**kw)


def _assert_clean(llm: LLM) -> None:
    """Every block and slot back: no holder, no owned snapshot slot."""
    c = llm.engine.cache
    assert c.blocks.num_used == 0 and c.blocks.num_free == c.blocks.capacity
    assert all(c.blocks.ref(b) == 0 for b in range(1, c.blocks.capacity + 1))
    assert c.slots.num_used == 0
    if c.snapshots is not None:
        assert c.snapshots.num_free + c.snapshots.num_keyed == c.snapshots.capacity


@pytest.fixture(scope="module")
def cold():
    return _llm(enable_prefix_caching=False)


def _hits(llm: LLM) -> tuple[int, int]:
    st = llm.engine.stats
    return st["prefix_cache_hit_requests"], st["prefix_cache_hits"]


def test_multi_turn_conversation_hits_and_matches_cold(cold):
    llm = _llm()
    conv_hot, conv_cold = _ids(70, 1), _ids(70, 1)
    for turn in range(3):
        hot, ref = _run(llm, [conv_hot], 20)[0], _run(cold, [conv_cold], 20)[0]
        assert hot == ref, f"turn {turn}"
        user = _ids(9 + turn, 10 + turn)
        conv_hot, conv_cold = conv_hot + hot + user, conv_cold + ref + user
    n, tokens = _hits(llm)
    # turns 2 and 3 start from the previous turn's last decode snapshot (<= 16 tokens before its end)
    assert n == 2 and tokens >= (70 + 20 - B) + (70 + 20 + 9 + 20 - B)
    assert cold.engine.stats["prefix_cache_hits"] == 0 and cold.engine.cache.usage()["kv_blocks_cached"] == 0
    _assert_clean(llm)


def test_shared_prefix_ending_mid_block(cold):
    """Two prompts share 150 tokens (block 9 is only partly shared): the second starts at 144, the
    first's last block boundary (a checkpoint: its prompt is longer than the interval)."""
    llm = _llm()
    base = _ids(150, 2)
    a, b = base + _ids(7, 3), base + _ids(30, 4)
    assert _run(llm, [a]) == _run(cold, [a])
    assert _run(llm, [b]) == _run(cold, [b])
    assert _hits(llm) == (1, 144)
    _assert_clean(llm)


def test_hit_on_a_snapshot_older_than_the_match(cold):
    """Chunks of 40 tokens and no interval cuts: the first prompt's states are snapshot at 80 only
    (and past its prompt), its blocks cached to 96; a prompt sharing 100 tokens matches 6 blocks,
    restores the snapshot at 80 and recomputes 80.. (the cached blocks 5 and 6 are not shared)."""
    llm = _llm(max_num_batched_tokens=40, prefix_snapshot_interval=4096)
    a = _ids(100, 5)
    b = a + _ids(20, 6)
    assert _run(llm, [a]) == _run(cold, [a])
    assert _run(llm, [b]) == _run(cold, [b])
    assert _hits(llm) == (1, 80)
    _assert_clean(llm)


def test_eviction_under_pressure(cold):
    """A small pool (32 blocks, 3 snapshots) serving 8 prompts with a common head, in pairs, each
    pair then once more: cached blocks and snapshots are evicted to make room, nothing fails, the
    repeats hit, outputs stay cold's."""
    llm = _llm(num_kv_blocks=32, num_snapshot_slots=3, max_num_seqs=4)
    head = _ids(40, 7)
    prompts = [head + _ids(60 + 7 * i, 20 + i) for i in range(8)]
    ref = _run(cold, prompts)
    for i in range(0, 8, 2):
        assert _run(llm, prompts[i : i + 2]) == ref[i : i + 2]
        assert _run(llm, prompts[i + 1 : i + 2]) == ref[i + 1 : i + 2]
    c = llm.engine.cache
    assert c.blocks.num_evicted > 0 and c.snapshots.num_evicted > 0
    assert _hits(llm)[0] > 0
    _assert_clean(llm)


def test_preemption_with_shared_blocks(cold):
    """Six requests on one cached 64-token head in a cache too small for all: requests holding
    shared blocks are preempted and resumed (recompute, from a hit again); outputs equal cold."""
    llm = _llm(num_kv_blocks=20, max_num_seqs=6, max_model_len=128)
    head = _ids(64, 8)
    _run(llm, [head + [1]], 1)  # caches the head (snapshots at 32 and 64)
    prompts = [head + _ids(20, 30 + i) for i in range(6)]
    ref = _run(cold, prompts, 40)
    assert _run(llm, prompts, 40) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert _hits(llm)[0] >= 6
    _assert_clean(llm)


@pytest.mark.parametrize("spec", ["ngram", "mtp"])
def test_speculative_decoding_on_hits(cold, spec):
    """Drafting requests served from hits (their prefix computed by another request) verify to cold
    greedy outputs; MTP drafts resume from the hit."""
    llm = _llm(speculative=spec, num_speculative_tokens=3, speculative_max_seqs=4)
    rep = _ids(12, 9)
    a = rep * 6
    b = a[:70] + rep * 2
    assert _run(llm, [a], 24) == _run(cold, [a], 24)
    verifies = llm.engine.stats["spec_verifies"]
    assert _run(llm, [b], 24) == _run(cold, [b], 24)
    assert _hits(llm)[0] == 1 and llm.engine.stats["spec_verifies"] > verifies
    _assert_clean(llm)


def test_scoring_and_prompt_logprobs_never_hit():
    llm = _llm()
    p = _ids(80, 11)
    _run(llm, [p])
    out = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
        max_tokens=2, temperature=0, prompt_logprobs=0, detokenize=False))[0]
    assert len(out.prompt_logprobs) == len(p) and _hits(llm) == (0, 0)
    assert llm.score([p])[0].shape[0] == len(p)
    _assert_clean(llm)


def test_abort_of_a_hit_request_frees_its_share():
    """A request aborted mid-decode while sharing cached blocks with a running one: the survivor's
    blocks stay held, its output stays cold's, everything is back in the pools at the end."""
    llm = _llm()
    head = _ids(64, 12)
    ref = _run(llm, [head + _ids(9, 13)], 16)  # caches the head (snapshots at 32 and 64)
    eng = llm.engine
    keep = eng.add_request(head + _ids(9, 13), _greedy(16))
    drop = eng.add_request(head + _ids(5, 14), _greedy(16))
    outs, steps = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
        steps += 1
        if steps == 3:
            shared = eng.requests[keep].block_ids[:4]
            assert eng.requests[drop].block_ids[:4] == shared
            assert all(eng.cache.blocks.ref(b) == 2 for b in shared)
            eng.abort_request(drop)
            assert all(eng.cache.blocks.ref(b) == 1 for b in shared)
    assert list(outs[keep].token_ids) == ref[0] and eng.requests == {}
    _assert_clean(llm)


@pytest.mark.parametrize("right", [True, False])
def test_verify_snapshots_kept_only_when_every_draft_is_accepted(cold, right):
    """Every decode step verifies 3 drafts ("repeat" never backs off): their snapshots at block
    boundaries hold the drafts' states, so they are keyed only where the drafts were all accepted
    (turn 2 then starts near turn 1's end) and freed where one was rejected (turn 2 starts at turn
    1's prompt-end snapshot)."""
    llm = _llm(speculative="repeat", num_speculative_tokens=3)
    a = _ids(48, 15)
    truth = _run(cold, [a], 40)[0]

    def drafter(req, k):  # the true continuation, or each of its tokens off by one
        cont = truth[len(req.output_token_ids):][:k]
        return cont if right else [(t + 1) % VOCAB for t in cont]

    llm.engine.proposer = drafter
    assert _run(llm, [a], 40)[0] == truth
    b = a + truth + _ids(5, 16)
    assert _run(llm, [b], 8) == _run(cold, [b], 8)
    _, hit = _hits(llm)
    assert llm.engine.stats["spec_verifies"] >= (10 if right else 35)
    assert hit >= 48 + 40 - 2 * B if right else hit == 48
    _assert_clean(llm)
