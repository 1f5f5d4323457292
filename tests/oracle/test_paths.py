"""Every engine path against the reference on fresh prompts (`metainfer.oracle.paths`), the coverage
a verdict records, and mutants that only the path checks catch: a broken lone-request path, a
wrong resume after preemption, a drafter whose drafts are all accepted, and a cheat that answers
prompts it has seen from a cache. Each mutant test prints its failing figures against their gates.
"""

from __future__ import annotations

import math

import pytest
import torch

from metainfer.engine.engine import LLMEngine
from metainfer.engine.executors import DecodeExecutor, EagerExecutor
from metainfer.engine.scheduler import Scheduler
from metainfer.oracle import path_runs, paths
from metainfer.oracle.compare import GATES, row_stats
from metainfer.oracle.engine_runs import greedy_batch

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_ngram(tiny_config):
    """The tiny engine with n-gram speculative decoding, and its reference."""
    from metainfer.oracle.build import build_setup

    return build_setup(f"dummy:{tiny_config}", "quick", {"device": "cpu", "speculative": "ngram"})


def _run(setup) -> tuple[dict, dict]:
    """path_checks on a setup -> ({check name: Check}, figures)."""
    checks, figures = paths.path_checks(setup.llm, setup.reference, setup.suite, GATES[setup.precision])
    return {c.name: c for c in checks}, figures


# path.prefix's first and last turns are lone requests too: a lone-path mutant may fail them as well
PREFIX = {"path.prefix.logits", "path.prefix.tokens"}


def _failed(checks: dict) -> set[str]:
    failed = {n for n, c in checks.items() if not c.passed}
    for n in sorted(failed):
        c = checks[n]
        fig = "n/a" if c.figure is None else f"{c.figure:.4g}"
        print(f"  {n}: {fig} vs gate {c.gate} ({c.detail[:160]})")
    return failed


def test_honest_engine_passes_every_path_and_coverage_is_filled(tiny):
    before = path_runs.stats_snapshot(tiny.llm)
    checks, figures = _run(tiny)
    cov = path_runs.coverage(before, dict(tiny.llm.engine.stats))
    assert not _failed(checks)
    # no spec: not speculative; prefix: prefix caching is on by default
    assert {n.split(".")[1] for n in checks} == {"alone", "mixed", "preempt", "prefix"}
    assert cov["preemptions"] >= 1 and cov["lone_prefill_steps"] >= 1 and cov["mixed_steps"] >= 1, cov
    assert cov["max_decode_batch"] >= figures["preempt"]["plan"]["W"] and cov["max_verify_batch"] == 0
    assert cov["max_position"] >= max(figures["alone"]["prompt_lens"]) + tiny.suite.gen_tokens - 1
    assert sum(cov["runner_paths"].values()) == cov["steps"] > 0
    assert figures["preempt"]["resumed"] and figures["alone"]["coverage"]["max_decode_batch"] == 1


def test_fresh_prompts_per_path(tiny):
    """Seeded from the suite's seed and the path's name: never the suite's prompts, never shared."""
    suite = tiny.suite
    tags = ("alone", "mixed", "preempt", "spec")
    streams = {tag: path_runs._ids(17, 512, path_runs._gen(suite, tag)) for tag in tags}
    assert len({tuple(v) for v in streams.values()}) == len(streams)
    assert not {tuple(v) for v in streams.values()} & {p.token_ids for p in suite.prompts}
    assert streams["alone"] == path_runs._ids(17, 512, path_runs._gen(suite, "alone"))  # deterministic


def test_coverage_needs_a_snapshot_and_keeps_the_outer_peaks(tiny):
    stats = dict(tiny.llm.engine.stats)
    if any(stats[k] for k in path_runs.PEAKS):
        with pytest.raises(ValueError, match="stats_snapshot"):
            path_runs.coverage(stats, stats)
    before = path_runs.stats_snapshot(tiny.llm)
    greedy_batch(tiny.llm, [[1, 2, 3], [4, 5]], 3)
    outer = tiny.llm.engine.stats["max_position"]
    with path_runs._window(tiny.llm) as inner:
        greedy_batch(tiny.llm, [[7]], 2)
    assert inner["max_position"] == 2 and inner["max_decode_batch"] == 1 and inner["lone_prefill_steps"] == 1
    cov = path_runs.coverage(before, dict(tiny.llm.engine.stats))
    assert cov["max_position"] == outer == 5 and cov["max_decode_batch"] == 2  # the window kept them


def test_preempt_plan_is_sized_from_the_cache(tiny):
    plan = paths.preempt_plan(tiny.llm)
    e = tiny.llm.engine
    assert plan["free_blocks"] == e.cache.blocks.capacity and plan["block_size"] == e.cache.block_size
    bs, w, b = plan["block_size"], plan["W"], plan["blocks_each"]
    assert w * (b - 1) <= plan["free_blocks"] < w * b  # the prefills fit, the decodes do not
    assert w * plan["P"] <= plan["token_budget"] and w <= min(plan["max_num_seqs"], plan["state_slots"])
    assert (b - 1) * bs < plan["P"] + plan["G"] - 1 <= b * bs  # positions computed end in block b
    assert plan["P"] + plan["G"] < plan["max_model_len"]


def test_no_preemption_fails_the_preempt_check(tiny, monkeypatch):
    """A wave that fits the cache preempts nothing: path.preempt reports coverage not reached."""
    real = paths.preempt_plan
    monkeypatch.setattr(paths, "preempt_plan", lambda llm: {**real(llm), "W": 2, "G": 6})
    checks, _ = _run(tiny)
    assert _failed(checks) == {"path.preempt.coverage", "path.preempt.logits"}  # (no resumed rows)
    assert checks["path.preempt.coverage"].figure == 0 and "no rows" in checks["path.preempt.logits"].detail


def _lone_only(orig, error: float, shared: set[str]):
    """Wraps an executor's run so that a request that never shared a step gets logits * (1 + error)."""

    def f(self, inputs):
        logits, hidden = orig(self, inputs)
        items = inputs.items
        if len(items) > 1:
            shared.update(r.request_id for r, _ in items)
        elif logits is not None and items[0][0].request_id not in shared:
            logits = logits * (1 + error)
        return logits, hidden

    return f


def test_mutant_lone_request_path(tiny, monkeypatch):
    """(a) A bug in the lone-request path only (prefill and batch-1 decode of a request that has the
    engine to itself, as in the batch-1 benchmark): the path checks see it directly."""
    shared: set[str] = set()
    for ex in (EagerExecutor, DecodeExecutor):
        monkeypatch.setattr(ex, "run", _lone_only(ex.run, 0.01, shared))
    checks, _ = _run(tiny)
    assert _failed(checks) - PREFIX == {"path.alone.logits"}
    assert checks["path.alone.logits"].figure > 10  # rel. RMSE ~1e-2 against a gate of 1e-4


def test_mutant_wrong_resume_after_preemption(tiny, monkeypatch):
    """(b) A preempted request resumes one position late (its first token is not recomputed: its
    KV row and DeltaNet state come from the slot's previous owner). Nothing else is preempted."""
    original = Scheduler._preempt

    def preempt(self, req):
        original(self, req)
        req.num_computed_tokens = 1

    monkeypatch.setattr(Scheduler, "_preempt", preempt)
    checks, figures = _run(tiny)
    assert figures["preempt"]["coverage"]["preemptions"] >= 1
    failed = _failed(checks)
    assert "path.preempt.logits" in failed and failed <= {"path.preempt.logits", "path.preempt.tokens"}


def test_honest_speculative_engine_passes(tiny_ngram):
    checks, figures = _run(tiny_ngram)
    assert not _failed(checks)
    spec = figures["spec"]
    assert spec["drafted"] > spec["accepted"] > 0 and spec["coverage"]["max_verify_batch"] >= 2, spec
    assert tiny_ngram.llm.engine.ecfg.speculative_max_seqs == 1  # restored after the call


def test_mutant_accepts_every_draft(tiny_ngram, monkeypatch):
    """(c) Every draft accepted: the verify rows are honest (computed on the drafts), the tokens are
    not the model's greedy tokens."""
    original = LLMEngine._accept

    def accept_all(self, req, n, inflight, now):
        greedy, drafts = inflight.verify[req.request_id], req.draft_token_ids
        inflight.verify[req.request_id] = list(drafts) + greedy[len(drafts) :]
        return original(self, req, n, inflight, now)

    monkeypatch.setattr(LLMEngine, "_accept", accept_all)
    checks, _ = _run(tiny_ngram)
    assert "path.spec.tokens" in _failed(checks)
    assert checks["path.spec.tokens"].figure > 0


def _old_alone_check(setup) -> tuple[float, int]:
    """The suite's `alone` prompts run alone and compared with the engine's own mixed batch (the
    check the path checks replace): -> (max rel. RMSE of decode rows, greedy token mismatches)."""
    s, llm = setup.suite, setup.llm
    prompts = [list(p.token_ids) for p in s.prompts]
    run = greedy_batch(llm, prompts, s.gen_tokens, s.late_from, s.late_after_steps)
    worst, bad = 0.0, 0
    for i in s.alone:
        solo = greedy_batch(llm, [prompts[i]], s.gen_tokens)
        bad += solo.tokens[0] != run.tokens[i]
        (a, n), (b, _) = solo.decode_rows(0), run.decode_rows(i)
        st = row_stats(a, b[:n])
        worst = max(worst, math.sqrt(float(st.sq_err.sum()) / float(st.sq_ref.sum())))
    return worst, bad


def test_mutant_answers_seen_prompts_from_a_cache(tiny, monkeypatch):
    """(d) An engine whose lone path is wrong but which serves a prompt it has seen in a batch from
    a cache of that batch's rows: the suite's alone-vs-batch comparison sees identical rows; the
    fresh prompt of path.alone is in no cache."""
    known: set[tuple[int, ...]] = set()
    memo: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}

    def cheat(orig):
        def f(self, inputs):
            logits, hidden = orig(self, inputs)
            items, owners = inputs.items, inputs.owners
            if logits is None:
                return logits, hidden
            if len(items) > 1:
                for k, (r, _, pos) in enumerate(owners):
                    known.add(tuple(r.prompt_token_ids))
                    memo[(tuple(r.prompt_token_ids), pos)] = logits[k].clone()
                return logits, hidden
            key = tuple(items[0][0].prompt_token_ids)
            if key in known:
                rows = [memo.get((key, p), logits[k]) for k, (_, _, p) in enumerate(owners)]
                return torch.stack(rows), hidden
            return logits * 1.02, hidden

        return f

    for ex in (EagerExecutor, DecodeExecutor):
        monkeypatch.setattr(ex, "run", cheat(ex.run))
    rr, bad = _old_alone_check(tiny)
    print(
        f"  old alone-vs-batch check: rel. RMSE {rr:.3g} (gate {GATES['float32'].batch_rel_rmse:g}), "
        f"{bad} token mismatches: fooled"
    )
    assert rr <= GATES["float32"].batch_rel_rmse and bad == 0
    checks, _ = _run(tiny)
    assert _failed(checks) - PREFIX == {"path.alone.logits"}
    assert checks["path.alone.logits"].figure > 10
