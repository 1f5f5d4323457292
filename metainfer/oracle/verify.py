"""The oracle's procedure: run the suite through the engine, teacher-force the reference along the
engine's own continuations (one forward per prompt), and turn the comparison into checks.

    run = greedy_batch(...)           the mixed continuous batch, decode rows via the logits hook
    scores = score_batch(...)         prompt + continuation, teacher-forced through the engine
    ref = reference.logits(seq)       one transformers forward per prompt
    -> prefill / decode logits checks, greedy prefix, sensitivity, batch invariance, determinism
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from metainfer.llm import LLM
from metainfer.oracle.compare import (
    GATES,
    Check,
    Gates,
    PathStats,
    allowed_misses,
    bias_check,
    check_ge,
    check_le,
    logits_checks,
    noise_scaled_gates,
    reference_quality,
    rel_rmse,
    row_stats,
)
from metainfer.oracle.engine_runs import GreedyRun, greedy_batch, sample_batch, score_batch
from metainfer.oracle.layers import layer_checks
from metainfer.oracle.path_runs import coverage, stats_snapshot
from metainfer.oracle.paths import path_checks
from metainfer.oracle.precision import reference_logits, reference_logits_batch
from metainfer.oracle.reference import Reference
from metainfer.oracle.sampling import sampling_checks
from metainfer.oracle.suites import Suite

DISTINCT_ROWS = 8  # leading prompt rows kept per prompt for the distinct-prompts check
SCORE_MAX_LEN = 4096  # longer prompts: judged on their decode rows (no [L, V] teacher-forced logits)
NOISE_SKIP = ("wide-",)  # prompts without a noise forward (the ratio is measured on the others' rows)
NOISE_MAX_LEN = 8192  # longer prompts: judged against the exact reference, no noise forward of their own
REF_BATCH = 16  # prompts without a noise forward share one exact reference forward, this many at a time
REF_BATCH_MAX_LEN = 256  # ... when prompt + continuation are at most this long
SEEDS = (1234, 4321, 777)


@dataclass(frozen=True)
class Verdict:
    """The oracle's ruling: every check with its figure and gate, plus everything needed to trust it."""

    passed: bool
    checks: tuple[Check, ...]
    figures: dict
    suite: dict
    gates: dict
    context: dict = field(default_factory=dict)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        return {
            "kind": "oracle-verdict",
            "passed": self.passed,
            "failed": self.failed,
            "checks": [c.to_dict() for c in self.checks],
            "figures": self.figures,
            "suite": self.suite,
            "gates": self.gates,
            **self.context,
        }


@dataclass
class _PromptRecord:
    """What the checks need from one prompt after its big tensors are freed."""

    ref_top: torch.Tensor  # [N] reference argmax at the generated positions
    ref_gap: torch.Tensor  # [N] reference top-1 logit gap there
    head: torch.Tensor  # [<= DISTINCT_ROWS, V] engine prefill rows, host


class _Timing(dict):
    """Phase -> seconds; each phase reported to `log` as it ends (a run cut short shows where)."""

    def __init__(self, log: Callable[[str], None] | None) -> None:
        super().__init__()
        self.log = log

    def __setitem__(self, key: str, value: float) -> None:
        super().__setitem__(key, value)
        if self.log is not None:
            self.log(f"verify: {key} {value:.1f}")


def verify_setup(
    setup, gates: Gates | None = None, context: dict | None = None,
    log: Callable[[str], None] | None = None,
) -> Verdict:
    """`run_verify` on a `metainfer.oracle.build.Setup`, with its precision's gates by default and
    its weights audit."""
    return run_verify(
        setup.llm, setup.reference, setup.suite, gates or GATES[setup.precision], context,
        audit=getattr(setup, "weights", None), log=log,
    )


def run_verify(
    llm: LLM, reference: Reference, suite: Suite, gates: Gates, context: dict | None = None, audit=None,
    log: Callable[[str], None] | None = None,
) -> Verdict:
    """Runs `suite` through `llm` and judges it against `reference` with `gates`. `audit`: an object
    whose `check()` -> (checks, figures) compares the engine's weights with the reference's, called
    last (after every engine and reference run). `log`: told each phase's seconds as it ends."""
    timing = _Timing(log)
    stats_before = stats_snapshot(llm)
    t = time.perf_counter()
    prompts = [list(p.token_ids) for p in suite.prompts]
    names = [p.name for p in suite.prompts]
    run = greedy_batch(llm, prompts, suite.gen_tokens, suite.late_from, suite.late_after_steps)
    timing["engine_generate_s"] = time.perf_counter() - t

    t = time.perf_counter()
    seqs = [p + c for p, c in zip(prompts, run.tokens)]
    scored = [i for i, p in enumerate(prompts) if len(p) <= SCORE_MAX_LEN]
    got = score_batch(llm, [seqs[i] for i in scored])
    scores: list[torch.Tensor | None] = [None] * len(seqs)
    for i, s in zip(scored, got):  # held on the host: [L, V] fp32 each, ~1 MB a row at 248k ids
        scores[i] = None if s is None else s.cpu()
        del s
    del got
    timing["engine_score_s"] = time.perf_counter() - t

    t = time.perf_counter()
    prefill, decode = PathStats(), PathStats()
    noise = {"prefill": PathStats(), "decode": PathStats()}  # the reference's own error, noise set
    measured = {"prefill": PathStats(), "decode": PathStats()}  # the engine's, on the same rows
    problems = list(run.problems)
    records: list[_PromptRecord] = []
    twin_ref: dict[int, torch.Tensor] = {}
    twin_eng: dict[int, torch.Tensor] = {}
    vocab = 0
    def measured_noise(i: int) -> bool:  # the reference's own error is measured on this prompt
        short = len(seqs[i]) <= NOISE_MAX_LEN
        return bool(gates.noise_mode) and not names[i].startswith(NOISE_SKIP) and short

    exact = _ExactRows(
        reference, seqs, [i for i in scored if not measured_noise(i) and len(seqs[i]) <= REF_BATCH_MAX_LEN]
    )
    for i, seq in enumerate(seqs):
        L, N = len(prompts[i]), len(run.tokens[i])
        long = i not in scored  # judged on its decode rows only (the reference keeps the last N + 1)
        keep = N + 1 if long else None
        ref = exact.get(i, keep)
        off = (L - 1) - (len(seq) - ref.shape[0])  # row of position L - 1 in `ref`
        vocab = ref.shape[-1]
        measure = measured_noise(i)
        nz = reference_logits(reference, seq, gates.noise_mode, keep) if measure else None
        eng = scores[i]
        scores[i] = None
        if not long:
            if eng is None or tuple(eng.shape) != tuple(ref.shape):
                problems.append(
                    f"{names[i]}: score returned {None if eng is None else tuple(eng.shape)}, "
                    f"expected {tuple(ref.shape)}"
                )
                eng = torch.full_like(ref, math.nan)
            eng = eng.to(ref.device)
            s = row_stats(eng, ref)
            prefill.add(names[i], s)
            if nz is not None:
                noise["prefill"].add(names[i], row_stats(nz, ref))
                measured["prefill"].add(names[i], s)
        rows, n = run.decode_rows(i)
        if n < N:
            problems.append(f"{names[i]}: logits hook delivered {n} of {N} decode rows")
        if rows is not None:
            d = row_stats(rows.to(ref.device), ref[off : off + n])
            decode.add(names[i], d)
            if nz is not None:
                noise["decode"].add(names[i], row_stats(nz[off : off + n], ref[off : off + n]))
                measured["decode"].add(names[i], d)
        if long:
            top = ref[off : off + N].topk(2, dim=-1)
            ref_top, ref_gap = top.indices[:, 0].cpu(), (top.values[:, 0] - top.values[:, 1]).cpu()
            head = torch.zeros(0, vocab)
        else:
            ref_top, ref_gap = s.ref_top[L - 1 : L - 1 + N], s.ref_gap[L - 1 : L - 1 + N]
            head = eng[: min(L, DISTINCT_ROWS)].cpu()
        records.append(_PromptRecord(ref_top, ref_gap, head))
        if i in suite.twins:
            half = L // 2
            twin_ref[i], twin_eng[i] = ref[half:L].clone(), eng[half:L].clone()
        del ref, eng, nz
        if log is not None and (i + 1) % 16 == 0:
            log(f"verify: reference {i + 1} of {len(seqs)} prompts {time.perf_counter() - t:.1f}")
    timing["reference_and_compare_s"] = time.perf_counter() - t

    figures: dict = {}
    checks: list[Check] = []
    if gates.noise_mode:
        gates, figures["noise_gates"] = noise_scaled_gates(gates, list(noise.values()))
    qual_checks, figures["reference"] = reference_quality([prefill], max(vocab, 2), gates)
    checks += qual_checks
    checks.append(_history_check(suite, twin_ref, twin_eng, gates, figures))
    for path, ps in (("prefill", prefill), ("decode", decode)):
        cs, figures[path] = logits_checks(
            path, ps, gates, (noise[path], measured[path]) if gates.noise_mode else None
        )
        checks += cs
    for path, ps in (("prefill", prefill), ("decode", decode)):
        c, figures[f"{path}_bias"] = bias_check(path, ps, gates)
        checks.append(c)
    checks += _greedy_checks(suite, run, records, gates, figures)
    checks.append(_distinct_check(prompts, names, records, gates, figures))

    t = time.perf_counter()
    checks += _batch_checks(llm, suite, run, records, gates, figures, problems)
    timing["engine_alone_s"] = time.perf_counter() - t
    t = time.perf_counter()
    checks += _determinism_checks(llm, suite, figures)
    timing["engine_sampling_s"] = time.perf_counter() - t
    t = time.perf_counter()
    cs, figures["layers"] = layer_checks(llm, reference, suite, gates)
    checks += cs
    timing["layers_s"] = time.perf_counter() - t
    t = time.perf_counter()
    cs, figures["sampling"] = sampling_checks(llm, reference, suite, gates.precision)
    checks += cs
    timing["sampling_judged_s"] = time.perf_counter() - t
    t = time.perf_counter()
    cs, figures["paths"] = path_checks(llm, reference, suite, gates)
    checks += cs
    timing["paths_s"] = time.perf_counter() - t
    figures["coverage"] = coverage(stats_before, dict(llm.engine.stats))
    if audit is not None:
        t = time.perf_counter()
        cs, figures["weights"] = audit.check()
        checks += cs
        timing["weights_audit_s"] = time.perf_counter() - t

    checks.insert(
        0,
        Check(
            "engine.complete", float(len(problems)), "== 0 problems", not problems, "; ".join(problems[:3])
        ),
    )
    figures["problems"] = problems
    figures["engine_steps"] = run.steps
    figures["engine_stats"] = dict(llm.engine.stats)  # steps, tokens, speculative verifies and drafts
    ctx = dict(context or {})
    ctx["timing"] = {k: round(v, 3) for k, v in dict(timing).items()}
    return Verdict(
        all(c.passed for c in checks), tuple(checks), figures, suite.describe(), gates.to_dict(), ctx
    )


class _ExactRows:
    """The exact reference's [L, V] logits of each sequence, asked for in order: the `batched`
    indices are computed REF_BATCH at a time in one padded forward (`reference_logits_batch`), the
    others one forward each."""

    def __init__(self, reference, seqs: list[list[int]], batched: list[int]) -> None:
        self.reference, self.seqs, self.batched = reference, seqs, batched
        self.ready: dict[int, torch.Tensor] = {}

    def get(self, i: int, keep: int | None) -> torch.Tensor:
        if i not in self.ready and i in self.batched:
            k = self.batched.index(i)
            group = self.batched[k : k + REF_BATCH]
            rows = reference_logits_batch(self.reference, [self.seqs[j] for j in group], "exact")
            self.ready.update(zip(group, rows))
        if i in self.ready:
            return self.ready.pop(i)
        return reference_logits(self.reference, self.seqs[i], "exact", keep)


def _history_check(suite: Suite, twin_ref, twin_eng, g: Gates, figures: dict) -> Check:
    a, b = suite.twins
    if a not in twin_ref or b not in twin_ref:
        return Check("suite.history", None, f">= {g.min_history:g}", False, "twins missing")
    ref_d = rel_rmse(twin_ref[b], twin_ref[a])
    eng_d = rel_rmse(twin_eng[b], twin_eng[a])
    figures["history"] = {
        "reference_rel_diff": ref_d,
        "engine_rel_diff": eng_d,
        "rows": int(twin_ref[a].shape[0]),
    }
    return check_ge(
        "suite.history",
        ref_d,
        g.min_history,
        f"twins differ in their first half; engine {eng_d:.3g} on the shared half",
    )


def _greedy_checks(
    suite: Suite, run: GreedyRun, records: list[_PromptRecord], g: Gates, figures: dict
) -> list[Check]:
    """The engine's emitted tokens vs the reference's argmax on the same prefix. The agreed prefix
    (equal until the first near-tie) must have no mismatch at all. The reference is teacher-forced
    along the engine's tokens, so every later position with a clear gap is judged too."""
    prefix, prefix_bad, checked, total, mismatches = [], [], 0, 0, []
    for i, rec in enumerate(records):
        name, toks = suite.prompts[i].name, run.tokens[i][: len(rec.ref_gap)]
        k = 0
        while k < len(toks) and float(rec.ref_gap[k]) >= g.tie_gap:
            if toks[k] != int(rec.ref_top[k]):
                prefix_bad.append(f"{name}@{k}")
                break
            k += 1
        prefix.append(k)
        total += len(toks)
        for j, t in enumerate(toks):
            if float(rec.ref_gap[j]) >= g.tie_gap:
                checked += 1
                if t != int(rec.ref_top[j]):
                    gap = float(rec.ref_gap[j])
                    mismatches.append(f"{name}@{j}: engine {t} ref {int(rec.ref_top[j])} (gap {gap:.2f})")
    frac = len(mismatches) / checked if checked else math.nan
    share = checked / max(1, total)
    mean = sum(prefix) / max(1, len(prefix))
    figures["greedy"] = {
        "prefix": prefix,
        "mean_prefix": mean,
        "prefix_mismatches": prefix_bad,
        "checked": checked,
        "total": total,
        "mismatches": mismatches,
    }
    return [
        Check(
            "greedy.prefix",
            mean,
            f">= {g.min_agreed:g} tokens, 0 mismatches",
            bool(mean >= g.min_agreed and not prefix_bad),
            f"mismatch before a near-tie: {', '.join(prefix_bad)}"
            if prefix_bad
            else f"mean tokens per prompt (of {suite.gen_tokens}) equal to the reference before a near-tie",
        ),
        Check(
            "greedy.mismatches",
            _num(frac),
            f"<= {g.max_mismatch_frac:g} (>= 1 token when > 0) where ref gap >= {g.tie_gap:g}",
            bool(len(mismatches) <= allowed_misses(g.max_mismatch_frac, checked)
                 and share >= g.min_clear_frac),
            "; ".join(mismatches[:2])
            or f"{checked} of {total} generated tokens judged ({share:.0%}, need >= {g.min_clear_frac:.0%})",
        ),
    ]


def _num(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def _distinct_check(prompts, names, records: list[_PromptRecord], g: Gates, figures: dict) -> Check:
    """Different prompts give different logits (over their leading rows)."""
    best = (math.inf, "")
    for i in range(len(records)):
        for j in range(i + 1, len(records)):
            m = min(len(records[i].head), len(records[j].head))
            if m == 0 or prompts[i][:m] == prompts[j][:m]:
                continue
            d = rel_rmse(records[i].head[:m], records[j].head[:m])
            if not d >= best[0]:
                best = (d, f"{names[i]} vs {names[j]}")
    figures["distinct"] = {"min_rel_diff": best[0], "pair": best[1]}
    return check_ge("sensitivity.distinct", best[0], g.min_distinct, f"closest pair {best[1]}")


def _batch_checks(
    llm, suite: Suite, run: GreedyRun, records, g: Gates, figures: dict, problems
) -> list[Check]:
    """Each `suite.alone` prompt run by itself must reproduce its logits from the mixed batch."""
    worst_rr, worst_kl, token_mismatch, detail = 0.0, 0.0, [], []
    for i in suite.alone:
        solo = greedy_batch(llm, [run.prompts[i]], suite.gen_tokens)
        problems += [f"alone {suite.prompts[i].name}: {p}" for p in solo.problems]
        a, b = solo.tokens[0], run.tokens[i]
        same = 0
        while same < min(len(a), len(b)) and a[same] == b[same]:
            same += 1
        if same < min(len(a), len(b)) and float(records[i].ref_gap[same]) >= g.tie_gap:
            token_mismatch.append(f"{suite.prompts[i].name}@{same}")
        ra, na = solo.decode_rows(0)
        rb, nb = run.decode_rows(i)
        n = min(na, nb, same + 1)
        if n == 0 or ra is None or rb is None:
            problems.append(f"alone {suite.prompts[i].name}: no comparable decode rows")
            continue
        s = row_stats(ra[:n].to(rb.device), rb[:n])
        rr = math.sqrt(float(s.sq_err.sum()) / float(s.sq_ref.sum()))
        kl = float(s.kl.max())
        worst_rr, worst_kl = _worse(worst_rr, rr), _worse(worst_kl, kl)
        detail.append(f"{suite.prompts[i].name}: {n} rows rr {rr:.2g} kl {kl:.2g}")
    figures["batch"] = {
        "rel_rmse_max": worst_rr,
        "kl_max": worst_kl,
        "token_mismatches": token_mismatch,
        "detail": detail,
    }
    return [
        check_le("batch.rel_rmse", worst_rr, g.batch_rel_rmse, "; ".join(detail)),
        check_le("batch.kl_max", worst_kl, g.batch_kl_max, "alone vs in the mixed batch"),
        check_le(
            "batch.tokens",
            float(len(token_mismatch)),
            0,
            ", ".join(token_mismatch) or "same greedy tokens alone and in the batch (until a near-tie)",
            fmt="g",
        ),
    ]


def _worse(a: float, b: float) -> float:
    return b if (math.isnan(b) or b > a) else a


def _determinism_checks(llm, suite: Suite, figures: dict) -> list[Check]:
    """Same seed => same tokens (across runs and within a batch); different seeds => different."""
    pa, pb = (list(suite.prompts[i].token_ids) for i in suite.sample_prompts)
    reqs = [(pa, SEEDS[0]), (pa, SEEDS[0])] + [(p, s) for p in (pa, pb) for s in SEEDS[1:]] + [(pb, SEEDS[0])]
    first = sample_batch(llm, reqs, suite.sample_tokens).tokens
    second = sample_batch(llm, reqs, suite.sample_tokens).tokens
    by_prompt = [{first[0], first[2], first[3]}, {first[6], first[4], first[5]}]
    same = [first == second, first[0] == first[1]]
    differ = [any(len(outs) > 1 for outs in by_prompt), first[0] != first[6]]
    figures["determinism"] = {
        "seeds": list(SEEDS),
        "runs_equal": same[0],
        "in_batch_equal": same[1],
        "distinct_outputs_per_prompt": [len(x) for x in by_prompt],
        "prompts_differ": differ[1],
        "tokens": [list(x) for x in first],
    }
    return [
        Check(
            "determinism.same_seed",
            float(sum(same)),
            "== 2 of 2",
            all(same),
            f"rerun identical: {same[0]}; duplicate request in the batch identical: {same[1]}",
        ),
        Check(
            "determinism.diff_seed",
            float(sum(differ)),
            "== 2 of 2",
            all(differ),
            f"distinct outputs of {len(SEEDS)} seeds per prompt: {[len(x) for x in by_prompt]}; "
            f"other prompt, same seed differs: {differ[1]}",
        ),
    ]
