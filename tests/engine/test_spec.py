"""Speculative decoding (n-gram drafts, verified in one step): greedy outputs equal plain decoding's
whatever the drafts are (all right, all wrong, half right, the n-gram proposer's), with stops,
max_tokens, preemption and sampled requests beside; a rejection restores the DeltaNet states; the
n-gram index proposes what followed the latest earlier occurrence of the suffix."""

from __future__ import annotations

import pytest

from metainfer.config import EngineConfig
from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM
from metainfer.spec.ngram import NgramIndex, propose_ngram
from tests.helpers import token_prompts, write_config


# ---- the n-gram proposer -------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_occurrence():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]  # the 3-gram (1, 2, 3)
    assert propose_ngram([1, 2, 3, 4, 1, 2], 5) == [3, 4, 1, 2, 3]  # past the end: the loop goes on
    assert propose_ngram([9, 9, 9, 9], 3) == [9, 9, 9]
    assert propose_ngram([7, 1, 2, 8, 1, 2, 9, 1, 2], 2) == [9, 1]  # the latest occurrence wins
    assert propose_ngram([5, 6, 7], 2) == [] and propose_ngram([5, 6, 5], 2) == []  # 1-grams: no
    assert propose_ngram([1, 2, 3, 1, 2], 0) == []
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_ngram_index_is_incremental():
    idx, seq = NgramIndex(), [1, 2, 3, 1, 2]
    for extra in ([], [3], [9, 1, 2], [4, 4, 4, 4]):
        seq += extra
        assert idx.propose(seq, 3) == propose_ngram(seq, 3)


# ---- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("spec"))


def _prompts():
    rep = token_prompts([6], seed=5)[0]
    return [rep * 4, token_prompts([9], seed=6)[0] + rep * 3, token_prompts([13], seed=7)[0], rep * 2 + [1]]


def _llm(cfg, spec, **kw) -> LLM:
    """An engine; with speculation, drafts in steps of up to 8 sequences (verifies of several)."""
    if spec:
        kw.setdefault("speculative_max_seqs", 8)
    return LLM(model=f"dummy:{cfg}", device="cpu", dtype="float32", speculative=spec, **kw)


def _gen(llm, prompts, params):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    usage = llm.engine.cache.usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0
    return [(o.token_ids, o.finish_reason, o.stop_reason) for o in outs]


GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_spec_equals_plain_greedy(cfg, async_scheduling):
    prompts = _prompts()
    plain = _gen(_llm(cfg, None), prompts, GREEDY)
    llm = _llm(cfg, "ngram", num_speculative_tokens=3, async_scheduling=async_scheduling)
    assert _gen(llm, prompts, GREEDY) == plain
    st = llm.engine.stats
    assert st["generation_tokens"] == sum(len(t) for t, *_ in plain)
    if async_scheduling:  # proposals that find nothing back off: most steps run async (no verify here)
        assert st["async_steps"] > st["steps"] / 2
    else:  # every step proposes: the output's own repeat (step 9) gave drafts
        assert st["spec_verifies"] > 0 and st["spec_drafted"] > 0
        assert st["spec_drafted"] <= 3 * st["spec_verifies"]  # at most num_speculative_tokens each


def test_spec_probes_back_off_and_resume(cfg):
    """With async steps on, a proposal that finds nothing lets the next 2, 4, ... SPEC_PROBE_MAX steps
    run async (no proposals: their last tokens are on the device); drafts found again run verifies
    (synchronous) until a proposal fails. Outputs equal plain decoding's throughout."""
    prompts = _prompts()[:1]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = _gen(_llm(cfg, None), prompts, params)
    truth = plain[0][0]
    llm = _llm(cfg, "ngram", num_speculative_tokens=2)
    calls = []

    def drafter(req, k):  # nothing for the first 12 tokens, then the true continuation
        n = len(req.output_token_ids)
        calls.append(n)
        return truth[n:][:k] if n >= 12 else []

    llm.engine.proposer = drafter
    assert _gen(llm, prompts, params) == plain
    st = llm.engine.stats
    misses = [n for n in calls if n < 12]
    gaps = [b - a for a, b in zip(misses, misses[1:])]
    assert gaps == sorted(gaps) and gaps[-1] <= llm.engine.SPEC_PROBE_MAX  # the backoff grows, capped
    assert len(misses) < 6 and st["async_steps"] >= 12 - len(misses) - 2
    assert st["spec_accepted"] == st["spec_drafted"] > 0 and st["steps"] < 12 + (40 - 12) / 2


def _scripted(llm, truth, how):
    """Replaces the proposer: drafts from the true continuation, then spoiled per `how`."""

    def drafter(req, k):
        cont = truth[tuple(req.prompt_token_ids)][len(req.output_token_ids) :][:k]
        if how == "wrong":
            return [(t + 1) % 512 for t in cont]
        if how == "half":
            return cont[: len(cont) // 2] + [(t + 1) % 512 for t in cont[len(cont) // 2 :]]
        return cont

    llm.engine.proposer = drafter


@pytest.mark.parametrize("how", ["right", "wrong", "half"])
def test_any_drafts_give_plain_greedy_outputs(cfg, how):
    prompts = _prompts()
    plain_llm = _llm(cfg, None)
    plain = _gen(plain_llm, prompts, GREEDY)
    truth = {tuple(p): t for p, (t, *_) in zip(prompts, plain)}
    llm = _llm(cfg, "ngram", num_speculative_tokens=4)
    _scripted(llm, truth, how)
    assert _gen(llm, prompts, GREEDY) == plain
    st = llm.engine.stats
    assert st["spec_drafted"] > 0
    if how == "right":  # every draft taken: far fewer steps
        assert st["spec_accepted"] == st["spec_drafted"]
        assert st["steps"] < plain_llm.engine.stats["steps"] / 2
    elif how == "wrong":  # every draft rejected: the states restored every time
        assert st["spec_accepted"] == 0
    else:
        assert 0 < st["spec_accepted"] < st["spec_drafted"]


def test_rejected_drafts_back_off_per_request(cfg):
    """Drafts that always verify to nothing: after r rejections in a row the request passes up its
    next min(2^r, SPEC_PROBE_MAX) drafting chances (growing gaps, few verifies); once a draft is
    accepted the request drafts at every chance again. Outputs equal plain decoding's."""
    prompts = _prompts()[:1]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    plain = _gen(_llm(cfg, None), prompts, params)
    truth = plain[0][0]
    llm = _llm(cfg, "ngram", num_speculative_tokens=3, async_scheduling=False)
    calls = []

    def drafter(req, k):  # wrong drafts for the first 30 tokens, then the true continuation
        n = len(req.output_token_ids)
        calls.append(n)
        cont = truth[n:][:k]
        return [(t + 1) % 512 for t in cont] if n < 30 else cont

    llm.engine.proposer = drafter
    assert _gen(llm, prompts, params) == plain
    wrong = [n for n in calls if n < 30]
    gaps = [b - a for a, b in zip(wrong, wrong[1:])]
    assert len(wrong) <= 5 and gaps == sorted(gaps) and gaps[-1] > 2  # backing off, not every step
    right = [n for n in calls if n >= 30]
    assert right and all(b - a <= 4 for a, b in zip(right, right[1:]))  # accepted: drafting resumed
    st = llm.engine.stats
    assert st["spec_accepted"] > 0 and st["spec_verifies"] < 30


def test_spec_stops_max_tokens_samples_and_preemption(cfg):
    prompts = _prompts() + token_prompts([3, 20], seed=8)
    plain = _gen(_llm(cfg, None), prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    stop_tok = plain[0][0][5]  # stops inside a run of accepted drafts
    params = [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=(stop_tok,)),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.8, seed=3, ignore_eos=True),  # sampled: no drafts
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, min_tokens=3),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
    ]
    kw = dict(max_num_batched_tokens=24, block_size=8, num_kv_blocks=8, max_model_len=64, max_num_seqs=6)
    want = _gen(_llm(cfg, None, **kw), prompts, params)
    assert want[0][1] == "stop" and len(want[0][0]) == 6 and len(want[1][0]) == 7
    truth = {tuple(p): t for p, (t, *_) in zip(prompts, plain)}
    llm = _llm(cfg, "ngram", num_speculative_tokens=4, **kw)
    _scripted(llm, truth, "half")
    assert _gen(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats["spec_accepted"] > 0


def test_spec_config_is_validated():
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_max_seqs"):
        EngineConfig(speculative="ngram", speculative_max_seqs=0)
    with pytest.raises(ValueError, match="speculative_draft_vocab"):
        EngineConfig(speculative="mtp", speculative_draft_vocab=-1)


def test_oracle_rows_of_a_speculative_run_are_plain_decodings(cfg):
    """The oracle's row capture keeps the latest row per position: after half-wrong drafts, every
    decode row it reads (positions L-1 .. L+n-2) equals plain decoding's (fp32: rel. RMSE < 1e-4)."""
    from metainfer.oracle.engine_runs import greedy_batch
    from tests.helpers import rel_rmse

    prompts = _prompts()
    plain = greedy_batch(_llm(cfg, None), prompts, 16)
    truth = {tuple(p): t for p, t in zip(prompts, plain.tokens)}
    llm = _llm(cfg, "ngram", num_speculative_tokens=4)
    _scripted(llm, truth, "half")
    spec = greedy_batch(llm, prompts, 16)
    assert spec.tokens == plain.tokens and not spec.problems
    assert 0 < llm.engine.stats["spec_accepted"] < llm.engine.stats["spec_drafted"]
    for i in range(len(prompts)):
        (a, na), (b, nb) = spec.decode_rows(i), plain.decode_rows(i)
        assert na == nb == 16 and rel_rmse(a, b) < 1e-4


@pytest.mark.slow  # CI's second pass; the default suite judges n-gram verify rows on the tiny model
# (tests/oracle/test_paths.py::test_honest_speculative_engine_passes) and the full verify of a
# speculative engine on the default model with repeat drafts (below), which verify every step
def test_oracle_passes_a_speculative_engine():
    """`metainfer verify --speculative ngram --speculative-max-seqs 16` on the default model (quick
    suite, fp32 gates): verifies beside other sequences too."""
    pytest.importorskip("transformers")
    from metainfer.oracle.build import build_setup
    from metainfer.oracle.report import format_table
    from tests.oracle.oracle_helpers import verify

    setup = build_setup("", "quick", {"device": "cpu", "speculative": "ngram", "speculative_max_seqs": 16})
    v = verify(setup)
    assert v.passed, format_table(v)
    assert setup.llm.engine.stats["spec_verifies"] > 0


def test_lone_verify_takes_the_prefill_graph_layout(cfg):
    """A verify (or a recompute) alone in its step runs through the lone-prefill graphs' padded
    layout with logits for its last 1 + K rows (CPU: the layout run eagerly), giving plain greedy
    outputs; with speculation the default graph sizes gain 2, 4, 1 + K, 8 and 16 tokens."""
    prompts = _prompts()
    plain = _gen(_llm(cfg, None), prompts, GREEDY)
    truth = {tuple(p): t for p, (t, *_) in zip(prompts, plain)}
    llm = _llm(cfg, "ngram", num_speculative_tokens=4, prefill_graphs=(4, 8, 16, 32))
    _scripted(llm, truth, "half")
    pg = llm.engine.runner.prefill
    assert pg is not None and pg.logits_indices.shape[0] == 5
    got = [_gen(llm, [p], GREEDY)[0] for p in prompts]  # one at a time: every step is lone
    assert got == plain
    assert pg.runs > len(prompts) and 0 < llm.engine.stats["spec_accepted"] < llm.engine.stats["spec_drafted"]
    assert EngineConfig(speculative="ngram").prefill_graph_sizes[:6] == (2, 4, 5, 8, 16, 128)  # 5: 1 + K
    assert EngineConfig().prefill_graph_sizes[0] == 128


def test_drafts_fit_the_step_budget_and_max_tokens(cfg):
    """The scheduler asks for at most min(K, budget - chunk, max_tokens - outputs - 1) drafts."""
    prompts = _prompts()[:2]
    plain = _gen(_llm(cfg, None, max_num_batched_tokens=5), prompts, GREEDY)
    truth = {tuple(p): t for p, (t, *_) in zip(prompts, plain)}
    llm = _llm(cfg, "ngram", num_speculative_tokens=8, max_num_batched_tokens=5)
    asked = []

    def proposer(req, k):
        asked.append((k, req.max_tokens - len(req.output_token_ids) - 1))
        return truth[tuple(req.prompt_token_ids)][len(req.output_token_ids):][:k]

    llm.engine.proposer = proposer
    assert _gen(llm, prompts, GREEDY) == plain
    assert asked and all(1 <= k <= min(4, left) for k, left in asked)  # budget 5 - 1 real token
    assert max(k for k, _ in asked) == 4 and min(left for _, left in asked) < 4  # both bounds bit


def test_drafts_only_while_the_step_would_hold_one_sequence(cfg):
    """The default speculative_max_seqs = 1: no proposal while other sequences run or wait (their
    verifies would run eager beside them); the last sequence left drafts. Outputs equal plain's."""
    prompts = _prompts()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 10, 14, 30)]
    plain = _gen(_llm(cfg, None), prompts, params)
    truth = {tuple(p): t for p, (t, *_) in zip(prompts, plain)}
    llm = _llm(cfg, "ngram", num_speculative_tokens=3, speculative_max_seqs=1)
    seen = []

    def drafter(req, k):
        seen.append(len(llm.engine.scheduler.running))
        return truth[tuple(req.prompt_token_ids)][len(req.output_token_ids) :][:k]

    llm.engine.proposer = drafter
    assert _gen(llm, prompts, params) == plain
    st = llm.engine.stats
    assert seen and set(seen) == {1} and st["spec_accepted"] == st["spec_drafted"] > 0


def test_repeat_proposer_verifies_every_step_and_equals_plain(cfg):
    """--speculative repeat drafts the last token K times: every eligible step is a verify (most drafts
    rejected, states restored), outputs equal plain greedy decoding's."""
    prompts = _prompts()
    plain = _gen(_llm(cfg, None), prompts, GREEDY)
    llm = _llm(cfg, "repeat", num_speculative_tokens=3)
    assert _gen(llm, prompts, GREEDY) == plain
    st = llm.engine.stats
    assert st["spec_verifies"] >= st["steps"] // 3 and st["spec_drafted"] > st["spec_accepted"]
    assert st["async_steps"] == 0 or st["spec_verifies"] > st["async_steps"]


def test_oracle_passes_a_repeat_speculative_engine():
    """`metainfer verify --speculative repeat --speculative-max-seqs 16`: the verify rows judged
    whatever the model generates (dummy weights give the n-gram proposer nothing)."""
    pytest.importorskip("transformers")
    from metainfer.oracle.build import build_setup
    from metainfer.oracle.report import format_table
    from tests.oracle.oracle_helpers import verify

    setup = build_setup("", "quick", {"device": "cpu", "speculative": "repeat", "speculative_max_seqs": 16})
    v = verify(setup)
    assert v.passed, format_table(v)
    st = setup.llm.engine.stats
    assert st["spec_verifies"] > 20 and st["spec_drafted"] > st["spec_accepted"]


def test_spec_bench_forced_acceptance_emits_the_script(cfg):
    """benchmarks/spec_bench.py's ceiling rows: with `force_acceptance` every verify accepts its drafts,
    so a run drafting an arbitrary script (here not the model's tokens) emits the script from its first
    verify on (the model's tokens before it) and counts every draft accepted."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "spec_bench.py"
    spec = importlib.util.spec_from_file_location("spec_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    llm = LLM(model=f"dummy:{cfg}", speculative="ngram", num_speculative_tokens=3)
    script = [(7 * i + 3) % 500 for i in range(40)]
    llm.engine.proposer = lambda req, k: script[len(req.output_token_ids):][:k]
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, detokenize=False)
    prompt = token_prompts([12], seed=5)[0]
    plain = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0].token_ids
    assert plain[1:] != script[1:30]  # the script is not what the model says
    bench.force_acceptance(llm, script)
    st0 = dict(llm.engine.stats)
    with bench.record_verifies(llm, 30) as log:  # (position, drafts, the model's own greedy tokens)
        got = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0].token_ids
    drafted, accepted = (llm.engine.stats[k] - st0[k] for k in ("spec_drafted", "spec_accepted"))
    assert log and accepted == drafted == sum(len(d) for _, d, _ in log) > 0
    first = log[0][0]
    assert got[:first] == plain[:first]  # before the first verify: the model's tokens
    for pos, drafts, greedy in log:  # each verify emits its drafts and the script's next token
        end = min(pos + len(drafts) + 1, 30)
        assert got[pos:end] == script[pos:end]
        assert greedy[: len(drafts)] != drafts  # the model itself would have rejected them

