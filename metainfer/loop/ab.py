"""The A/B's figures and the verdict rule, as pure functions of the rounds' measurements.

Per metric and side, one figure per round (a fresh process each). change = the candidate's median
relative to the base's, signed so that > 0 is better. noise band = max(min_gain, the wider of the
two sides' relative ranges (max - min) / median): a gain inside it is indistinguishable from a rerun.
Rounds won: the rounds in which the candidate's figure beats the base's of the same round (the two ran
back to back, so a load that drifts over the A/B moves both). Accept only when the primary metric's
change exceeds its band, the candidate won every round, and no other metric's change is below
-tolerance.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from metainfer.loop.config import Metric


@dataclass(frozen=True)
class MetricAB:
    name: str
    better: str
    base: tuple[float, ...]  # one figure a round
    candidate: tuple[float, ...]
    base_median: float
    candidate_median: float
    change: float  # relative, > 0 = better
    band: float  # relative noise band
    tolerance: float
    rounds_won: int  # rounds whose candidate figure beats the base's

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _spread(xs: tuple[float, ...]) -> float:
    med = statistics.median(xs)
    return (max(xs) - min(xs)) / abs(med) if med else float("inf")


def compare(metric: Metric, base: list[float], cand: list[float], min_gain: float) -> MetricAB:
    if not base or not cand:
        raise ValueError(f"{metric.name}: no measurements")
    b, c = tuple(base), tuple(cand)
    bm, cm = statistics.median(b), statistics.median(c)
    sign = 1.0 if metric.better == "higher" else -1.0
    change = sign * (cm - bm) / abs(bm) if bm else (0.0 if cm == bm else sign * float("inf"))
    band = max(min_gain, _spread(b), _spread(c))
    won = sum(sign * (ci - bi) > 0 for bi, ci in zip(b, c))
    return MetricAB(metric.name, metric.better, b, c, bm, cm, change, band, metric.tolerance, won)


@dataclass(frozen=True)
class Decision:
    accepted: bool
    category: str  # accepted | noise | regression
    reason: str


def decide(results: list[MetricAB], primary: str) -> Decision:
    by = {r.name: r for r in results}
    p = by[primary]
    regressed = [r for r in results if r.name != primary and r.change < -r.tolerance]
    if regressed:
        worst = ", ".join(
            f"{r.name} {100 * r.change:+.1f}% (tolerance {100 * r.tolerance:.1f}%)" for r in regressed
        )
        return Decision(False, "regression", f"another goal metric regressed beyond its tolerance: {worst}")
    if p.change <= p.band:
        return Decision(
            False,
            "noise",
            f"{primary} {100 * p.change:+.1f}% is within the noise band "
            f"{100 * p.band:.1f}% ({p.base_median:.4g} -> {p.candidate_median:.4g})",
        )
    if p.rounds_won < len(p.base):
        return Decision(
            False,
            "noise",
            f"{primary} {100 * p.change:+.1f}% but the candidate won only {p.rounds_won} of {len(p.base)} "
            f"rounds ({p.base_median:.4g} -> {p.candidate_median:.4g})",
        )
    return Decision(
        True,
        "accepted",
        f"{primary} {100 * p.change:+.1f}% beyond the noise band "
        f"{100 * p.band:.1f}% ({p.base_median:.4g} -> {p.candidate_median:.4g})",
    )


def round_order(rnd: int) -> tuple[str, str]:
    """Which side runs first in round `rnd`: base in even rounds, the candidate in odd ones."""
    return ("base", "candidate") if rnd % 2 == 0 else ("candidate", "base")


def lookup(doc: Any, key: str) -> float:
    """The number at dotted path `key` in a JSON document; KeyError/ValueError naming the path."""
    cur = doc
    for part in key.split("."):
        if isinstance(cur, list) and part.isdigit():
            cur = cur[int(part)]
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            raise KeyError(f"{key}: no {part!r}")
    if isinstance(cur, bool) or not isinstance(cur, int | float):
        raise ValueError(f"{key}: {cur!r} is not a number")
    return float(cur)
