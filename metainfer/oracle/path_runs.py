"""What every oracle path shares: coverage windows over the engine's stats, fresh seeded prompts per path,
and one judged engine run (`_drive`, `_judge`): every sampled row against the reference and the emitted
greedy tokens against its argmax where clear."""

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
