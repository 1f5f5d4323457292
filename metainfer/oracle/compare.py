"""Metrics of engine logits against reference logits, the gates per precision, and checks.

Every figure is computed row by row (one row = one position's next-token logits [V]) in chunks, so
a 4k-token prompt over a 248k vocabulary never needs more than a few [chunk, V] temporaries.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

ROW_CHUNK = 256
BIAS_Z = 6.0  # standard errors of rounding noise a per-token bias must exceed
GAP_Z = 4.0  # a reference gap is clear at this many standard deviations of the engine's allowed gap error


@dataclass(frozen=True)
class Gates:
    """Pass/fail thresholds. Logit gaps and biases are in nats (logit units); KL in nats."""

    precision: str
    # the suite must be able to see errors
    max_entropy_frac: float = 0.75  # mean reference entropy <= this fraction of ln V (blind: ~0.97)
    min_prob_margin: float = 0.05  # mean reference top-1 minus top-2 probability
    min_history: float = 0.02  # twins' reference logits differ by this rel. RMSE on their shared half
    # teacher-forced logits (prefill rows via score, decode rows via the logits hook)
    rel_rmse: float = 1e-4
    kl_mean: float = 1e-6
    kl_max: float = 1e-4
    clear_gap: float = 1e-3  # top-1 agreement is judged where the reference's top-1 gap >= this
    top1_agree: float = 1.0
    min_clear_frac: float = 0.1  # ... and at least this share of rows must be clear
    bias: float = 1e-3  # per-token systematic logit offset beyond noise (see bias_check)
    # greedy continuation along the engine's own tokens
    tie_gap: float = 1e-3  # a smaller reference top-1 gap is a near-tie: not judged, ends the prefix
    max_mismatch_frac: float = 0.0  # emitted tokens that differ from the reference's clear argmax
    min_agreed: float = 8.0  # mean agreed prefix per prompt, in tokens
    # sensitivity
    min_distinct: float = 0.1  # different prompts: engine logits differ by at least this rel. RMSE
    batch_rel_rmse: float = 1e-4  # a prompt alone vs in the mixed batch
    batch_kl_max: float = 1e-4
    # low precision: the engine's error against the exact (float32-compute) reference, over the
    # reference's own error at that precision on the same rows (metainfer.oracle.precision)
    noise_mode: str | None = None  # native (BF16) | fp8 (the published FP8 format) | None
    noise_ratio_rmse: float | None = None  # rel. RMSE ratio
    noise_ratio_kl: float | None = None  # mean-KL ratio
    layer_ratio: float | None = None  # the same rel. error ratio for each layer's contribution (layers.py)

    def to_dict(self) -> dict:
        return asdict(self)


GATES: dict[str, Gates] = {
    "float32": Gates("float32"),
    "bfloat16": Gates(
        "bfloat16",
        rel_rmse=0.08,
        kl_mean=0.06,
        kl_max=2.0,
        clear_gap=1.5,
        top1_agree=0.98,
        bias=0.05,
        tie_gap=2.0,
        max_mismatch_frac=0.01,
        min_agreed=0.25,
        batch_rel_rmse=0.08,
        batch_kl_max=2.0,
        noise_mode="native",
        noise_ratio_rmse=1.5,
        noise_ratio_kl=2.25,
        layer_ratio=1.3,
    ),
    "fp8": Gates(
        "fp8",
        rel_rmse=0.25,
        kl_mean=0.3,
        kl_max=10.0,
        clear_gap=3.0,
        top1_agree=0.95,
        bias=0.3,
        tie_gap=3.0,
        max_mismatch_frac=0.05,
        min_agreed=0.1,
        batch_rel_rmse=0.08,
        batch_kl_max=2.0,
        noise_mode="fp8",
        noise_ratio_rmse=1.5,
        noise_ratio_kl=2.25,
        layer_ratio=1.3,
    ),
}


@dataclass(frozen=True)
class Check:
    """One line of the verdict: a figure, its gate, and whether it passed."""

    name: str
    figure: float | None
    gate: str  # human-readable, e.g. "<= 0.05"
    passed: bool
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def check_le(name: str, figure: float, limit: float, detail: str = "", fmt: str = ".3g") -> Check:
    return Check(name, _num(figure), f"<= {limit:{fmt}}", bool(figure <= limit), detail)


def check_ge(name: str, figure: float, limit: float, detail: str = "", fmt: str = ".3g") -> Check:
    return Check(name, _num(figure), f">= {limit:{fmt}}", bool(figure >= limit), detail)


def _num(x: float) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


@dataclass
class RowStats:
    """Per-row figures of engine vs reference logits, on the host."""

    kl: torch.Tensor  # [n] KL(ref || engine)
    sq_err: torch.Tensor  # [n] sum over V of (engine - ref)^2
    sq_ref: torch.Tensor  # [n] sum over V of ref^2
    eng_top: torch.Tensor  # [n]
    ref_top: torch.Tensor  # [n]
    ref_gap: torch.Tensor  # [n] top-1 minus top-2 reference logit
    ref_entropy: torch.Tensor  # [n]
    ref_pmargin: torch.Tensor  # [n] top-1 minus top-2 reference probability
    gap_err: torch.Tensor  # [n] engine gap minus reference gap, at the reference's top-1 and top-2
    bias_sum: torch.Tensor  # [V] fp64 sum over rows of the row-centred (engine - ref), on the device
    bias_sq: torch.Tensor  # [V] fp64 sum of its squares


@torch.no_grad()
def row_stats(eng: torch.Tensor, ref: torch.Tensor) -> RowStats:
    """eng, ref [n, V] (any float dtype, same device) -> RowStats."""
    if eng.shape != ref.shape:
        raise ValueError(f"engine logits {tuple(eng.shape)} vs reference {tuple(ref.shape)}")
    parts: list[list[torch.Tensor]] = [[] for _ in range(9)]
    bias = torch.zeros(ref.shape[-1], dtype=torch.float64, device=ref.device)
    bias_sq = torch.zeros_like(bias)
    for i in range(0, ref.shape[0], ROW_CHUNK):
        e, r = eng[i : i + ROW_CHUNK].float(), ref[i : i + ROW_CHUNK].float()
        lr = r.log_softmax(-1)  # the same routine on both sides: its rounding cancels in the KL
        pr = lr.exp()
        d = e - r
        top = r.topk(2, dim=-1)
        ptop = lr.gather(-1, top.indices).exp()
        etop = e.gather(-1, top.indices)
        d_mean = d.mean(-1, keepdim=True)
        for k, x in enumerate(
            (
                (pr * (lr - e.log_softmax(-1))).sum(-1),
                d.square().sum(-1).double(),
                r.square().sum(-1).double(),
                e.argmax(-1),
                top.indices[:, 0],
                top.values[:, 0] - top.values[:, 1],
                -(pr * lr).sum(-1),
                ptop[:, 0] - ptop[:, 1],
                (etop[:, 0] - etop[:, 1]) - (top.values[:, 0] - top.values[:, 1]),
            )
        ):
            parts[k].append(x.cpu())
        dc = d - d_mean
        bias += dc.sum(0).double()
        bias_sq += dc.square().sum(0).double()
    return RowStats(*(torch.cat(p) for p in parts), bias, bias_sq)


@dataclass
class PathStats:
    """RowStats accumulated over many prompts for one engine path (prefill or decode)."""

    rows: list[RowStats] = field(default_factory=list)
    worst_prompt: dict[str, tuple[str, float]] = field(default_factory=dict)

    def add(self, prompt: str, s: RowStats) -> None:
        self.rows.append(s)
        rr = _rel(s.sq_err.sum(), s.sq_ref.sum())
        kl = float(s.kl.max()) if len(s.kl) else 0.0
        for key, v in (("rel_rmse", rr), ("kl_max", kl)):
            if key not in self.worst_prompt or not v <= self.worst_prompt[key][1]:
                self.worst_prompt[key] = (prompt, v)

    def cat(self, attr: str) -> torch.Tensor:
        return torch.cat([getattr(s, attr) for s in self.rows]) if self.rows else torch.zeros(0)

    @property
    def num_rows(self) -> int:
        return sum(len(s.kl) for s in self.rows)

    def figures(self, clear_gap: float) -> dict[str, float]:
        kl = self.cat("kl")
        clear = self.cat("ref_gap") >= clear_gap
        agree = self.cat("eng_top") == self.cat("ref_top")
        n_clear = int(clear.sum())
        return {
            "rows": self.num_rows,
            "rel_rmse": _rel(self.cat("sq_err").sum(), self.cat("sq_ref").sum()),
            "kl_mean": float(kl.double().mean()) if len(kl) else math.nan,
            "kl_p99": float(kl.double().quantile(0.99)) if len(kl) else math.nan,
            "kl_max": float(kl.max()) if len(kl) else math.nan,
            "top1_agree_all": float(agree.double().mean()) if len(kl) else math.nan,
            "clear_rows": n_clear,
            "clear_agree": int(agree[clear].sum()),
            "clear_frac": n_clear / max(1, len(kl)),
            "top1_agree_clear": float(agree[clear].double().mean()) if n_clear else math.nan,
        }


def allowed_misses(frac: float, judged: int) -> int:
    """Disagreements a share `frac` allows among `judged` positions; one at least when frac > 0, so a
    single unlucky rounding flip among a few dozen judged positions does not fail a low-precision build."""
    return max(1, math.floor(frac * judged)) if frac > 0 else 0


def _rel(num: torch.Tensor, den: torch.Tensor) -> float:
    return math.sqrt(float(num) / float(den)) if float(den) > 0 else math.nan


def rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over all elements (b is the baseline)."""
    a, b = a.double(), b.double()
    return _rel((a - b).pow(2).sum(), b.pow(2).sum())


def logits_checks(
    path: str, ps: PathStats, g: Gates, noise: tuple[PathStats, PathStats] | None = None
) -> tuple[list[Check], dict]:
    """rel. RMSE, KL mean / max and top-1 agreement at clear positions for one engine path; with
    `noise` = (the reference's own low-precision rows against the exact reference, the engine's on
    the same rows), the engine's rel. RMSE and mean KL over the reference's own: the noise gates."""
    f = ps.figures(g.clear_gap)
    worst = {k: {"prompt": p, "value": v} for k, (p, v) in ps.worst_prompt.items()}
    f["worst"] = worst
    wr, wk = worst.get("rel_rmse", {}), worst.get("kl_max", {})
    clear_ok = f["clear_frac"] >= g.min_clear_frac
    top1 = f["top1_agree_clear"]
    checks = [
        check_le(
            f"{path}.rel_rmse",
            f["rel_rmse"],
            g.rel_rmse,
            f"{f['rows']} rows; worst prompt {wr.get('prompt')} {wr.get('value', math.nan):.3g}",
        ),
        check_le(f"{path}.kl_mean", f["kl_mean"], g.kl_mean, f"p99 {f['kl_p99']:.3g}"),
        check_le(f"{path}.kl_max", f["kl_max"], g.kl_max, f"in prompt {wk.get('prompt')}"),
        Check(
            f"{path}.top1_clear",
            _num(top1),
            f">= {g.top1_agree:.3g} (>= 1 row off when < 1) where ref gap >= {g.clear_gap:.3g}",
            bool(clear_ok and f["clear_rows"] - f["clear_agree"]
                 <= allowed_misses(1 - g.top1_agree, f["clear_rows"])),
            f"{f['clear_rows']} clear rows ({f['clear_frac']:.0%}, need >= {g.min_clear_frac:.0%}); "
            f"all rows {f['top1_agree_all']:.3f}",
        ),
    ]
    if noise is not None and g.noise_ratio_rmse is not None and g.noise_ratio_kl is not None:
        n, e = noise[0].figures(g.clear_gap), noise[1].figures(g.clear_gap)
        rr = e["rel_rmse"] / n["rel_rmse"] if n["rel_rmse"] > 0 else math.inf
        rk = e["kl_mean"] / n["kl_mean"] if n["kl_mean"] > 0 else math.inf
        f["noise"] = {"mode": g.noise_mode, "rows": n["rows"], "rel_rmse": n["rel_rmse"],
                      "kl_mean": n["kl_mean"], "engine_rel_rmse": e["rel_rmse"],
                      "engine_kl_mean": e["kl_mean"], "rel_rmse_ratio": rr, "kl_mean_ratio": rk}
        what = f"the reference's own {g.noise_mode} error"
        checks += [
            check_le(f"{path}.noise_rmse", rr, g.noise_ratio_rmse,
                     f"engine rel. RMSE {e['rel_rmse']:.3g} / {what} {n['rel_rmse']:.3g} ({n['rows']} rows)"),
            check_le(f"{path}.noise_kl", rk, g.noise_ratio_kl,
                     f"engine mean KL {e['kl_mean']:.3g} / {what} {n['kl_mean']:.3g}"),
        ]
    return checks, f


def noise_scaled_gates(g: Gates, noise: list[PathStats]) -> tuple[Gates, dict]:
    """Lowers the clear / tie gaps to GAP_Z x noise_ratio_rmse x the reference's own top-2 gap error
    (RMS over the noise rows) where that is below the fixed ones: on a model whose rounding moves
    gaps little (a trained model, smaller logits) more rows are judged, never fewer."""
    err = torch.cat([p.cat("gap_err") for p in noise]) if noise else torch.zeros(0)
    if g.noise_ratio_rmse is None or len(err) == 0:
        return g, {}
    sigma = float(err.double().square().mean().sqrt())
    scaled = GAP_Z * g.noise_ratio_rmse * sigma
    out = replace(g, clear_gap=min(g.clear_gap, scaled), tie_gap=min(g.tie_gap, scaled))
    return out, {"gap_noise_rms": sigma, "scaled_gap": scaled, "clear_gap": out.clear_gap,
                 "tie_gap": out.tie_gap, "rows": len(err)}


def bias_check(path: str, ps: PathStats, g: Gates) -> tuple[Check, dict]:
    """A token the engine systematically favours or disfavours. Per token: the mean over rows of
    (engine - reference), each row centred (softmax ignores a per-row shift), less BIAS_Z standard
    errors of that mean (rounding noise averages out; a bias does not). Figure: the max over tokens."""
    n = ps.num_rows
    if n == 0:
        return Check(f"{path}.bias", None, f"<= {g.bias:g}", False, "no rows"), {}
    mean = torch.stack([s.bias_sum for s in ps.rows]).sum(0) / n
    se = ((torch.stack([s.bias_sq for s in ps.rows]).sum(0) / n - mean.square()).clamp(min=0) / n).sqrt()
    excess = mean.abs() - BIAS_Z * se
    v, tok = excess.max(0)
    t = int(tok)
    fig = {
        "max_bias_beyond_noise": float(v),
        "token": t,
        "mean": float(mean[t]),
        "stderr": float(se[t]),
        "max_abs_mean": float(mean.abs().max()),
        "rows": n,
        "z": BIAS_Z,
    }
    detail = f"token {t}: mean {float(mean[t]):+.3g} +- {float(se[t]):.2g} over {n} rows"
    detail += f" (|mean| - {BIAS_Z:g} s.e.)"
    return check_le(f"{path}.bias", float(v), g.bias, detail), fig


def reference_quality(paths: list[PathStats], vocab: int, g: Gates) -> tuple[list[Check], dict]:
    """Can the judge see? A near-uniform reference hides every error; the suite then fails."""
    ent = torch.cat([p.cat("ref_entropy") for p in paths])
    pm = torch.cat([p.cat("ref_pmargin") for p in paths])
    gap = torch.cat([p.cat("ref_gap") for p in paths])
    ln_v = math.log(vocab)
    f = {
        "mean_entropy": float(ent.double().mean()),
        "ln_vocab": ln_v,
        "entropy_frac": float(ent.double().mean()) / ln_v,
        "mean_top1_prob_margin": float(pm.double().mean()),
        "median_top1_logit_gap": float(gap.double().median()),
    }
    return [
        check_le(
            "suite.entropy",
            f["entropy_frac"],
            g.max_entropy_frac,
            f"mean {f['mean_entropy']:.3g} nats of ln V = {ln_v:.3g}",
            fmt=".0%",
        ),
        check_ge(
            "suite.margin",
            f["mean_top1_prob_margin"],
            g.min_prob_margin,
            f"median top-1 logit gap {f['median_top1_logit_gap']:.3g}",
        ),
    ], f
