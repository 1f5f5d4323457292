"""`metainfer sam verify`'s judge: our model against transformers' Sam3Model (fp32, TF32 off) on the same
weights and the same preprocessed tensors, over a seeded suite of synthetic scenes.

Gates (GATES) are stated in every report: raw outputs on all queries, the postprocessed detections,
batched-vs-one-by-one equality of our model, prompt dependence, the empty-result case, determinism.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from metainfer.sam.model import SamModel, SamOutput
from metainfer.sam.processing import Detections, postprocess, preprocess, rle_encode
from metainfer.sam.reference import Reference
from metainfer.sam.scenes import COLOURS, SHAPES, prompt_for, render_scene
from metainfer.sam.tokenizer import PromptTokenizer

THRESHOLD = 0.5  # score threshold of the postprocessing under test
MASK_THRESHOLD = 0.5
# gate: (comparison, value); figures are over every (image, prompt) of the suite
GATES: dict[str, tuple[str, float]] = {
    "score_max_abs_diff": ("<=", 0.01),  # all queries, sigmoid(logit) × sigmoid(presence)
    "box_l1_max": ("<=", 2e-3),  # per query: mean |Δ| of the 4 normalised coordinates; max over queries
    "mask_logit_cosine_min": (">=", 0.999),  # per prompt: cosine of all its queries' mask logits; min
    "kept_set_agreement": (">=", 0.98),  # Σ|kept ∩ kept_ref| / Σ|kept ∪ kept_ref| (1 when both empty)
    "matched_mask_iou_mean": (">=", 0.98),  # queries kept by both: IoU of the image-size binary masks
    "matched_mask_iou_min": (">=", 0.95),
    "matched_box_px_max": ("<=", 1.0),  # queries kept by both: max |Δ| of box corners, pixels
    "batch_score_max_abs_diff": ("<=", 0.01),  # ours: all prompts in one batch vs each prompt alone
    "batch_mask_logit_cosine_min": (">=", 0.999),
    "prompt_dependence_ratio_min": (">=", 0.5),  # ours / reference: max score change between two prompts
    "empty_result_kept": ("<=", 0.0),  # detections kept by ours on the empty-result prompts
    "deterministic_max_abs_diff": ("<=", 0.0),  # ours, the same batch twice
}


@dataclass
class Case:
    image: np.ndarray  # [H, W, 3] uint8
    prompts: list[str]
    empty: list[bool]  # per prompt: names a concept absent from the image


@dataclass
class Suite:
    name: str
    cases: list[Case]


def _concepts(scene) -> set[tuple[str, str]]:
    return {(i.colour, i.shape) for i in scene.instances}


def build_suite(name: str, seed: int = 0) -> Suite:
    """quick: 3 images of odd sizes, 1 to 3 prompts each, one empty-result prompt; full: 6 images from
    37×53 to 1333×750 and 1008² itself, 1 to 4 prompts each, two empty-result prompts."""
    if name == "quick":
        sizes, counts, with_empty = [(97, 131), (160, 90), (64, 200)], [1, 3, 2], {2}
    elif name == "full":
        sizes = [(750, 1333), (640, 480), (53, 37), (1008, 1008), (301, 999), (224, 224)]
        counts, with_empty = [4, 1, 2, 3, 2, 4], {2, 4}
    else:
        raise ValueError(f"unknown suite {name!r}")
    rng = np.random.default_rng(seed)
    cases = []
    for k, ((h, w), n) in enumerate(zip(sizes, counts)):
        scene = render_scene(rng, h, w, n_objects=int(rng.integers(2, 6)))
        n_present = n - (k in with_empty)
        prompts = [
            prompt_for(scene.instances[i % len(scene.instances)], rng, plural=bool(i % 2))
            for i in range(n_present)
        ]
        if k in with_empty:  # a concept absent from the image
            present = _concepts(scene)
            absent = [(c, s) for c in COLOURS for s in SHAPES if (c, s) not in present]
            c, s = absent[int(rng.integers(len(absent)))]
            prompts.append(f"{c} {s}")
        cases.append(Case(scene.image, prompts, [False] * n_present + [True] * (k in with_empty)))
    return Suite(name, cases)


@dataclass
class Check:
    name: str
    value: float
    op: str
    gate: float
    passed: bool
    detail: str = ""


@dataclass
class Verdict:
    passed: bool
    checks: list[Check]
    context: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "target": "sam",
            "passed": self.passed,
            **self.context,
            "checks": [asdict(c) for c in self.checks],
        }


def _cat(outs: list[SamOutput]) -> SamOutput:
    return SamOutput(
        *(torch.cat([getattr(o, f) for o in outs]) for f in ("logits", "presence_logits", "boxes", "masks"))
    )


def _float(o: SamOutput) -> SamOutput:
    return SamOutput(o.logits.float(), o.presence_logits.float(), o.boxes.float(), o.masks.float())


def _mask_cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[P, ...] -> [P] cosine of each prompt's flattened mask logits."""
    return torch.nn.functional.cosine_similarity(a.flatten(1).double(), b.flatten(1).double(), dim=1)


def _box_l1(a: SamOutput, b: SamOutput) -> float:
    return (a.boxes - b.boxes).abs().mean(-1).max().item()


def _iou(a: torch.Tensor, b: torch.Tensor) -> float:
    union = (a | b).sum().item()
    return 1.0 if union == 0 else (a & b).sum().item() / union


@torch.no_grad()
def run_model(model: SamModel, pixels, ids, valid, index) -> SamOutput:
    p0 = next(model.parameters())
    return _float(model(pixels.to(p0.dtype), ids, valid, index))


def verify(
    model: SamModel,
    tok: PromptTokenizer,
    suite: Suite,
    reference: Reference | None = None,
    log=lambda m: None,
) -> Verdict:
    """Judge `model` on `suite`. `reference` defaults to one built from the model's own weights."""
    p0 = next(model.parameters())
    dev, size = p0.device, model.config.image_size
    t0 = time.perf_counter()
    ref = reference or Reference(model)
    log(f"reference built ({time.perf_counter() - t0:.1f} s)")
    pixels = torch.stack([preprocess(c.image, size) for c in suite.cases]).to(dev)  # fp32 [B, 3, S, S]
    prompts = [p for c in suite.cases for p in c.prompts]
    index = torch.tensor([i for i, c in enumerate(suite.cases) for _ in c.prompts], device=dev)
    ids, valid = (t.to(dev) for t in tok.encode(prompts))
    sizes = [c.image.shape[:2] for c in suite.cases for _ in c.prompts]
    empty = [e for c in suite.cases for e in c.empty]

    t0 = time.perf_counter()
    ours = run_model(model, pixels, ids, valid, index)
    again = run_model(model, pixels, ids, valid, index)
    single = _cat(
        [
            run_model(model, pixels[i : i + 1], ids[p : p + 1], valid[p : p + 1], index[p : p + 1] * 0)
            for p, i in enumerate(index.tolist())
        ]
    )
    log(f"ours: batched twice + one by one ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    refs, start = [], 0
    for i, c in enumerate(suite.cases):
        n = len(c.prompts)
        refs.append(_float(ref(pixels[i : i + 1], ids[start : start + n], valid[start : start + n])))
        start += n
    r = _cat(refs)
    log(f"reference: {len(suite.cases)} images ({time.perf_counter() - t0:.1f} s)")

    lowp_drift = None
    if p0.dtype != torch.float32:  # the reference's own drift in our precision: context for the gates
        t0 = time.perf_counter()
        lows, start = [], 0
        for i, c in enumerate(suite.cases):
            n = len(c.prompts)
            lows.append(ref(pixels[i : i + 1], ids[start : start + n], valid[start : start + n], p0.dtype))
            start += n
        low = _cat(lows)
        lowp_drift = {
            "dtype": str(p0.dtype).removeprefix("torch."),
            "score_max_abs_diff": (low.scores() - r.scores()).abs().max().item(),
            "box_l1_max": _box_l1(low, r),
            "mask_logit_cosine_min": _mask_cos(low.masks, r.masks).min().item(),
        }
        log(f"reference in {lowp_drift['dtype']} ({time.perf_counter() - t0:.1f} s)")

    figures: dict[str, float] = {}
    details: dict[str, str] = {}
    so, sr = ours.scores(), r.scores()
    figures["score_max_abs_diff"] = (so - sr).abs().max().item()
    figures["box_l1_max"] = _box_l1(ours, r)
    cos = _mask_cos(ours.masks, r.masks)
    figures["mask_logit_cosine_min"] = cos.min().item()
    per_query = torch.nn.functional.cosine_similarity(
        ours.masks.flatten(2).double(), r.masks.flatten(2).double(), dim=2
    )
    details["mask_logit_cosine_min"] = f"per query min {per_query.min().item():.6f}"

    det_o = postprocess(ours, sizes, THRESHOLD, MASK_THRESHOLD)
    det_r = postprocess(r, sizes, THRESHOLD, MASK_THRESHOLD)
    inter = union = 0
    ious, box_px = [], [0.0]
    for a, b in zip(det_o, det_r):
        ka, kb = set(a.query.tolist()), set(b.query.tolist())
        inter, union = inter + len(ka & kb), union + len(ka | kb)
        for q in ka & kb:
            ia, ib = a.query.tolist().index(q), b.query.tolist().index(q)
            ious.append(_iou(a.masks[ia], b.masks[ib]))
            box_px.append((a.boxes[ia] - b.boxes[ib]).abs().max().item())
    figures["kept_set_agreement"] = 1.0 if union == 0 else inter / union
    details["kept_set_agreement"] = f"{inter} common of {union} kept by either"
    figures["matched_mask_iou_mean"] = float(np.mean(ious)) if ious else 1.0
    figures["matched_mask_iou_min"] = float(np.min(ious)) if ious else 1.0
    details["matched_mask_iou_mean"] = f"{len(ious)} matched detections"
    figures["matched_box_px_max"] = max(box_px)

    figures["batch_score_max_abs_diff"] = (so - single.scores()).abs().max().item()
    figures["batch_mask_logit_cosine_min"] = _mask_cos(ours.masks, single.masks).min().item()

    ratios, start = [], 0
    for c in suite.cases:
        n = len(c.prompts)
        if n >= 2:
            dep_o = (so[start : start + n, None] - so[None, start : start + n]).abs().max().item()
            dep_r = (sr[start : start + n, None] - sr[None, start : start + n]).abs().max().item()
            if dep_r > 0.05:
                ratios.append(dep_o / dep_r)
        start += n
    figures["prompt_dependence_ratio_min"] = min(ratios) if ratios else 1.0
    details["prompt_dependence_ratio_min"] = f"{len(ratios)} images with several prompts"

    figures["empty_result_kept"], details["empty_result_kept"] = _empty_check(ours, r, det_o, sizes, empty)
    figures["deterministic_max_abs_diff"] = max(
        (ours.logits - again.logits).abs().max().item(), (ours.masks - again.masks).abs().max().item()
    )

    checks = []
    for name, (op, gate) in GATES.items():
        v = figures[name]
        ok = v <= gate if op == "<=" else v >= gate
        checks.append(Check(name, v, op, gate, bool(ok and np.isfinite(v)), details.get(name, "")))
    context = {
        "suite": suite.name,
        "images": len(suite.cases),
        "prompts": len(prompts),
        "threshold": THRESHOLD,
        "mask_threshold": MASK_THRESHOLD,
        "kept_ours": sum(len(d.query) for d in det_o),
        "kept_reference": sum(len(d.query) for d in det_r),
        "reference_own_drift": lowp_drift,
    }
    return Verdict(all(c.passed for c in checks), checks, context)


def _empty_check(ours, r, det_o: list[Detections], sizes, empty: list[bool]) -> tuple[float, str]:
    """Detections ours keeps on the empty-result prompts. Where the reference itself keeps some (untrained
    weights name no concept), the prompt is judged at a threshold just above the reference's best score."""
    kept, notes = 0, []
    for p, is_empty in enumerate(empty):
        if not is_empty:
            continue
        best = r.scores()[p].max().item()
        if best <= THRESHOLD:
            d = det_o[p]
            notes.append(f"prompt {p}: reference empty at {THRESHOLD}")
        else:
            thr = min(best + 0.02, 0.999)
            d = postprocess(
                SamOutput(
                    *(t[p : p + 1] for t in (ours.logits, ours.presence_logits, ours.boxes, ours.masks))
                ),
                [sizes[p]],
                thr,
                MASK_THRESHOLD,
            )[0]
            notes.append(f"prompt {p}: reference keeps some, judged at {thr:.3f}")
        kept += len(d.query)
        if len(rle_encode(d.masks)) != len(d.query):
            kept += 1
    return float(kept), "; ".join(notes)


def format_table(v: Verdict) -> str:
    rows = [f"{'check':32} {'value':>12}  {'gate':>12}  result"]
    for c in v.checks:
        rows.append(
            f"{c.name:32} {c.value:12.6g}  {c.op} {c.gate:<9.4g}  {'PASS' if c.passed else 'FAIL'}"
            + (f"  ({c.detail})" if c.detail else "")
        )
    d = v.context.get("reference_own_drift")
    if d:
        rows.append(
            f"reference's own {d['dtype']} drift from its fp32 run: score {d['score_max_abs_diff']:.3g}, "
            f"box L1 {d['box_l1_max']:.3g}, mask cosine {d['mask_logit_cosine_min']:.6f}"
        )
    rows.append(
        f"verdict: {'PASS' if v.passed else 'FAIL'} ({sum(c.passed for c in v.checks)}/{len(v.checks)})"
    )
    return "\n".join(rows)
