"""Every engine path judged against the reference directly, on fresh prompts per path, and the
coverage a verdict records.

    checks, figures = path_checks(llm, reference, suite, gates)
    before = stats_snapshot(llm); ...; figures["coverage"] = coverage(before, dict(llm.engine.stats))

Each path gets its own random prompts (seeded from `suite.seed` and the path's name: never the
suite's, never another path's), one engine call, and the reference teacher-forced along the
engine's own tokens. Judged per path: every sampled row (the logits hook: the prefill's sampled row
and each decode or verify row) within the logits gates, the emitted greedy tokens equal to the
reference's argmax where its top-1 gap is clear, and the coverage the path exists for:

- `path.alone`: one prompt alone (a lone prefill step, then batch-1 decode steps: the decode CUDA
  graph on the GPU);
- `path.mixed`: two prompts arriving while three others decode (steps with prefill and decode rows);
- `path.preempt`: a wave sized from the engine's own cache so that KV blocks run out during decode
  and a request that already generated tokens is preempted and resumed (recompute): every
  request's tokens are judged, and the rows of the resumed requests from their resume on;
- `path.spec` (speculative engines only): four sequences drafting and verifying at once;
- `path.prefix` (prefix caching on): a conversation served from cache hits (`prefix_paths`).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from metainfer.engine.engine import PEAK_STATS
from metainfer.oracle.compare import Check, Gates, PathStats, check_ge, check_le, row_stats
from metainfer.oracle.engine_runs import greedy_batch
from metainfer.oracle.suites import ORDINARY_IDS, Suite

SPEC_SEQS = 4  # sequences speculating at once in path.spec
PEAKS = PEAK_STATS  # the widest decode and verify steps (sequences), the longest context (tokens)
COUNTS = ("steps", "lone_prefill_steps", "mixed_steps", "preemptions", "spec_verifies", "spec_drafted",
          "spec_accepted")  # fmt: skip
RUNNER_PATHS = ("decode_graph", "prefill_graph", "eager")


def stats_snapshot(llm) -> dict:
    """The engine's stats at the start of a judged window, its peaks reset (so that the peaks at
    the end belong to the window). Pass it to `coverage` as `stats_before`."""
    llm.engine.reset_peaks()
    return dict(llm.engine.stats)


def coverage(stats_before: dict, stats_after: dict) -> dict:
    """The verdict's coverage section: what the engine ran between two snapshots of its stats.
    stats_before must come from `stats_snapshot` (peaks zero); counters are differences, peaks
    (the widest decode and verify steps in sequences, the longest context in tokens) are maxima."""
    if any(stats_before.get(k, 0) for k in PEAKS):
        raise ValueError("stats_before must come from stats_snapshot(llm), which resets the peaks")
    out: dict = {k: int(stats_after.get(k, 0)) for k in PEAKS}
    out.update({k: int(stats_after.get(k, 0) - stats_before.get(k, 0)) for k in COUNTS})
    out["runner_paths"] = {
        p: int(stats_after.get(f"path_{p}", 0) - stats_before.get(f"path_{p}", 0)) for p in RUNNER_PATHS
    }
    return out


@contextmanager
def _window(llm) -> Iterator[dict]:
    """Coverage of the steps inside the block (filled in on exit). The engine's peaks go on
    covering the outer window: they end as the larger of the outer and the inner maxima."""
    st = llm.engine.stats
    outer = {k: st.get(k, 0) for k in PEAKS}
    before = stats_snapshot(llm)
    box: dict = {}
    try:
        yield box
    finally:
        box.update(coverage(before, dict(st)))
        for k in PEAKS:
            st[k] = max(st[k], outer[k])


@contextmanager
def _engine_config(eng, **changes) -> Iterator[None]:
    """The engine's EngineConfig with `changes` (fields the engine reads at every step) inside."""
    saved = eng.ecfg
    eng.ecfg = dataclasses.replace(saved, **changes)
    try:
        yield
    finally:
        eng.ecfg = saved


def _gen(suite: Suite, tag: str) -> torch.Generator:
    """A generator per path: seeded from the suite's seed and the path's name."""
    return torch.Generator().manual_seed(zlib.crc32(f"metainfer.oracle.paths/{tag}/{suite.seed}".encode()))


def _ids(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, min(vocab, ORDINARY_IDS), (n,), generator=gen).tolist()


@dataclass
class _Run:
    """One path's engine call: prompts, greedy continuations, the rows kept (position -> logits [V]
    predicting position + 1; the latest row of a position wins), and each request's preemption
    count at every sampled or verify row (rows sampled before and after a preemption: a resume
    with generated tokens)."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    rows: list[dict[int, torch.Tensor]]
    preempted_at: list[dict[int, int]]  # position -> the request's num_preemptions at that row
    problems: list[str] = field(default_factory=list)

    def resumed(self) -> list[int]:
        return [i for i, d in enumerate(self.preempted_at) if d and min(d.values()) == 0 < max(d.values())]

    def resume_pos(self, i: int) -> int:
        """The first position request i sampled after its first preemption."""
        return min(p for p, n in self.preempted_at[i].items() if n > 0)


def _drive(
    llm,
    prompts: Sequence[Sequence[int]],
    gen: int,
    late_from: int | None = None,
    late_after: int = 0,
    resumed_rows_only: bool = False,
) -> _Run:
    """`engine_runs.greedy_batch` plus the preemption record: every sampled and verify row is kept,
    or with `resumed_rows_only` those after a request's preemption only (a wave that fills the KV
    cache decodes about as many rows as the cache has tokens: [V] each, too many to keep)."""
    preempted_at: list[dict[int, int]] = [{} for _ in prompts]

    def on_row(i: int, req, pos: int) -> None:
        preempted_at[i][pos] = req.num_preemptions

    keep = (lambda req: req.num_preemptions > 0) if resumed_rows_only else None
    g = greedy_batch(llm, prompts, gen, late_from, late_after, keep=keep, on_row=on_row)
    return _Run(g.prompts, g.tokens, g.rows, preempted_at, g.problems)


def _judge(
    name: str,
    reference,
    run: _Run,
    g: Gates,
    cov: dict,
    reached: tuple[float, float, str],
    fig: dict,
    rows_from: dict[int, int] | None = None,
) -> tuple[list[Check], dict]:
    """Rows and tokens of every request against the reference, teacher-forced along the request's
    own tokens (one forward each). Rows: positions L-1 .. L+N-2 of every request, or with
    `rows_from` (request -> first position) of those requests only, from there; a missing row is
    a problem. `reached` = (coverage figure, its minimum, what it counts).
    -> the path's checks (path.<name>.logits / .tokens / .coverage) and its figures."""
    ps, problems = PathStats(), list(run.problems)
    checked, total, mismatches = 0, 0, []
    for i, (prompt, toks) in enumerate(zip(run.prompts, run.tokens)):
        if not toks:
            continue
        ref = reference.logits(prompt + toks)
        L, N = len(prompt), len(toks)
        first = L - 1 if rows_from is None else rows_from.get(i)
        if first is not None:
            want = range(first, L - 1 + N)
            got = [p for p in want if p in run.rows[i]]
            if len(got) < len(want):
                problems.append(f"request {i}: the logits hook delivered {len(got)} of {len(want)} rows")
            if got:
                rows = torch.stack([run.rows[i][p] for p in got]).to(ref.device)
                ps.add(f"{name}-{i}", row_stats(rows, ref[torch.tensor(got, device=ref.device)]))
        run.rows[i] = {}
        top = ref[L - 1 : L - 1 + N].topk(2, dim=-1)
        gap = (top.values[:, 0] - top.values[:, 1]).tolist()
        for j, (t, r) in enumerate(zip(toks, top.indices[:, 0].tolist())):
            total += 1
            if gap[j] >= g.tie_gap:
                checked += 1
                if t != r:
                    mismatches.append(f"request {i}@{j}: engine {t} ref {r} (gap {gap[j]:.2f})")
        del ref
    nan = {"rows": 0, "rel_rmse": math.nan, "kl_mean": math.nan, "kl_max": math.nan}
    f = ps.figures(g.clear_gap) if ps.num_rows else nan
    ratios = [f[k] / getattr(g, k) for k in ("rel_rmse", "kl_mean", "kl_max")]
    worst = math.nan if any(math.isnan(r) for r in ratios) or problems else max(ratios)
    share = len(mismatches) / checked if checked else math.nan
    figures = {
        **fig,
        "requests": len(run.prompts),
        "rows": f["rows"],
        "rel_rmse": f["rel_rmse"],
        "kl_mean": f["kl_mean"],
        "kl_max": f["kl_max"],
        "tokens_checked": checked,
        "tokens_total": total,
        "mismatches": mismatches,
        "problems": problems,
        "coverage": cov,
    }
    logits_detail = (
        "; ".join(problems[:2])
        or ("no rows judged" if not ps.num_rows else None)
        or (
            f"rel. RMSE {f['rel_rmse']:.3g} (gate {g.rel_rmse:g}), mean KL {f['kl_mean']:.3g} "
            f"({g.kl_mean:g}), max KL {f['kl_max']:.3g} ({g.kl_max:g}) over {f['rows']} rows"
        )
    )
    fig_, need, what = reached
    checks = [
        check_le(f"path.{name}.logits", worst, 1.0, logits_detail),
        Check(
            f"path.{name}.tokens",
            None if math.isnan(share) else share,
            f"<= {g.max_mismatch_frac:g} where ref gap >= {g.tie_gap:g}",
            bool(share <= g.max_mismatch_frac and checked >= g.min_clear_frac * max(1, total)),
            "; ".join(mismatches[:2]) or f"{checked} of {total} emitted tokens judged",
        ),
        check_ge(f"path.{name}.coverage", fig_, need, what, fmt="g"),
    ]
    return checks, figures


def _alone(llm, reference, suite: Suite, g: Gates) -> tuple[list[Check], dict]:
    eng = llm.engine
    gen_n = suite.gen_tokens
    n = max(2, min(eng.scheduler.token_budget * 3 // 4 + 1, eng.max_model_len - gen_n - 1))
    prompt = _ids(n, eng.model_config.vocab_size, _gen(suite, "alone"))
    with _window(llm) as cov:
        run = _drive(llm, [prompt], gen_n)
    reached = (cov["lone_prefill_steps"], 1, f"lone prefill steps; runner paths {cov['runner_paths']}")
    return _judge("alone", reference, run, g, cov, reached, {"prompt_lens": [n]})


def _mixed(llm, reference, suite: Suite, g: Gates) -> tuple[list[Check], dict]:
    eng = llm.engine
    gen_n = suite.gen_tokens
    cap = eng.max_model_len - gen_n - 1
    lens = [min(k, cap) for k in (3, 9, 20, eng.scheduler.token_budget // 2 + 3, 2)]
    gen = _gen(suite, "mixed")
    prompts = [_ids(k, eng.model_config.vocab_size, gen) for k in lens]
    with _window(llm) as cov:
        run = _drive(llm, prompts, gen_n, late_from=3, late_after=2)
    reached = (
        cov["mixed_steps"],
        1,
        f"steps with prefill and decode rows (widest decode {cov['max_decode_batch']})",
    )
    return _judge("mixed", reference, run, g, cov, reached, {"prompt_lens": lens, "late_from": 3})


def preempt_plan(llm, margin: int = 4) -> dict:
    """A wave that must preempt, sized from the engine's cache: W prompts of P tokens, G tokens each.

    W is as wide as max_num_seqs and the free state slots allow, and W * P fits the scheduler's
    token budget, so every prompt is prefilled in the first step and the wave decodes in lockstep.
    Each request's sequence ends in its b-th block, b = ceil((free blocks + 1) / W): W * (b - 1)
    blocks fit the cache, W * b do not. When the wave's decodes cross into their b-th block the
    cache runs out and the scheduler preempts (recompute) a request that has generated tokens,
    whatever it reserved ahead (MTP reserves draft KV blocks); the victim resumes once others
    finish, `margin` + 1 tokens before its end at least. Each request alone fits (b blocks,
    P + G < max_model_len).
    -> {"W", "P", "G", "blocks_each", cache sizes}, or {"error": why, cache sizes}."""
    eng = llm.engine
    cache, sch = eng.cache, eng.scheduler
    bs, free, budget, mml = cache.block_size, cache.blocks.num_free, sch.token_budget, eng.max_model_len
    w = min(sch.max_num_seqs, cache.slots.num_free, budget)
    plan = dict(free_blocks=free, block_size=bs, state_slots=cache.slots.num_free,
                max_num_seqs=sch.max_num_seqs, token_budget=budget, max_model_len=mml)  # fmt: skip
    b = -(-(free + 1) // max(1, w))
    p = max(1, budget // max(1, w))
    g = (b - 1) * bs + 2 - p + margin
    if w < 2 or g < 2 or p + g >= mml:
        why = f"{w} sequences (max_num_seqs, state slots, budget) of < {mml} tokens fit {free} blocks of {bs}"
        return {**plan, "error": why + ": this engine cannot run out of KV blocks"}
    return {**plan, "W": w, "P": p, "G": g, "blocks_each": b}


def _preempt(llm, reference, suite: Suite, g: Gates) -> tuple[list[Check], dict]:
    eng = llm.engine
    plan = preempt_plan(llm)
    if "error" in plan:
        fig = {"plan": plan, "coverage": {}}
        return [Check("path.preempt.coverage", None, ">= 1 resumed request", False, plan["error"])], fig
    gen = _gen(suite, "preempt")
    prompts = [_ids(plan["P"], eng.model_config.vocab_size, gen) for _ in range(plan["W"])]
    # no drafts while the whole wave runs: accepted drafts would let some requests finish early and
    # free their blocks before the others need theirs (speculation is judged by path.spec)
    spec_seqs = min(eng.ecfg.speculative_max_seqs, plan["W"] - 1)
    with _engine_config(eng, speculative_max_seqs=spec_seqs), _window(llm) as cov:
        run = _drive(llm, prompts, plan["G"], resumed_rows_only=True)
    resumed = run.resumed()
    what = (
        f"requests resumed after a preemption with generated tokens ({cov['preemptions']} "
        f"preemptions; wave of {plan['W']} x ({plan['P']} + {plan['G']}) tokens in "
        f"{plan['free_blocks']} blocks of {plan['block_size']})"
    )
    rows_from = {i: run.resume_pos(i) for i in resumed}
    fig = {"plan": plan, "resumed": resumed, "resumed_at": rows_from}
    return _judge("preempt", reference, run, g, cov, (len(resumed), 1, what), fig, rows_from)


def _spec(llm, reference, suite: Suite, g: Gates) -> tuple[list[Check], dict]:
    """SPEC_SEQS prompts built so that every sequence has n-gram drafts at its first decode step
    (`_spec_prompt`), so they verify together. For the call, the engine's `speculative_max_seqs` is
    raised to SPEC_SEQS (it limits how many sequences may draft, not how they verify) and its probe
    backoff is reset (a performance policy that earlier batches set)."""
    eng = llm.engine
    gen = _gen(suite, "spec")
    w = min(SPEC_SEQS, eng.scheduler.max_num_seqs, eng.cache.slots.num_free)
    prompts = [_spec_prompt(reference, eng.model_config.vocab_size, gen) for _ in range(w)]
    gen_n = min(suite.gen_tokens, eng.max_model_len - len(prompts[0]) - 1)
    ecfg = eng.ecfg
    eng.reset_spec_backoff()  # earlier batches' proposals that found nothing must not delay these
    with _engine_config(eng, speculative_max_seqs=max(ecfg.speculative_max_seqs, w)), _window(llm) as cov:
        run = _drive(llm, prompts, gen_n)
    wide = cov["max_verify_batch"] if cov["spec_drafted"] > 0 else 0
    what = (
        f"sequences verifying in one step (need >= 2, and drafts: {cov['spec_drafted']} drafted, "
        f"{cov['spec_accepted']} accepted in {cov['spec_verifies']} verifies, mode {ecfg.speculative})"
    )
    fig = {"sequences": w, "drafted": cov["spec_drafted"], "accepted": cov["spec_accepted"]}
    return _judge("spec", reference, run, g, cov, (wide, 2, what), fig)


def _spec_prompt(reference, vocab: int, gen: torch.Generator, tries: int = 3) -> list[int]:
    """A prompt X whose greedy continuation y0 the n-gram drafter finds after X's last token: X
    starts with [X[-1], y0, y1, y2, r] + 8 random ids (y the reference's greedy continuation of the
    random ids, r a random id), so once the engine emits y0 the drafts are y1, y2 (usually
    accepted), then r (usually rejected). The reference's y0 is checked on X itself (the front
    changes the context): rebuilt up to `tries` times."""
    body = _ids(8, vocab, gen)
    for _ in range(tries):
        y = _chain(reference, body, 3)
        x = [body[-1], *y, *_ids(1, vocab, gen), *body]
        if int(reference.logits(x)[-1].argmax()) == y[0]:
            break
        body = x
    return x


def _chain(reference, ids: list[int], n: int) -> list[int]:
    """The reference's greedy continuation of `ids`, n tokens (n forwards)."""
    out = list(ids)
    for _ in range(n):
        out.append(int(reference.logits(out)[-1].argmax()))
    return out[len(ids) :]


def path_checks(llm, reference, suite: Suite, gates: Gates) -> tuple[list[Check], dict]:
    """Every path against the reference directly (module docstring), on an idle engine.
    -> (checks: path.<name>.logits / .tokens / .coverage per path, figures: {name: figures})."""
    if llm.engine.has_unfinished():
        raise RuntimeError("path_checks needs an idle engine: the preemption wave is sized to its free cache")
    paths = [("alone", _alone), ("mixed", _mixed), ("preempt", _preempt)]
    if llm.engine.ecfg.speculative:
        paths.append(("spec", _spec))
    if llm.engine.cache.prefix_caching:
        from metainfer.oracle.prefix_paths import prefix_path

        paths.append(("prefix", prefix_path))
    checks: list[Check] = []
    figures: dict = {}
    for name, fn in paths:
        cs, figures[name] = fn(llm, reference, suite, gates)
        checks += cs
    return checks, figures
