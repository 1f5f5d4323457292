"""Scene sampling for the default model's training, and its held-out evaluation: mean IoU of the target
instances (Hungarian-matched to the kept detections; unmatched = 0) and the fraction of prompts answered
with exactly the right number of instances."""

from __future__ import annotations

import numpy as np
import torch

from metainfer.sam.model import SamModel
from metainfer.sam.processing import postprocess, preprocess
from metainfer.sam.scenes import (
    COLOURS,
    SHAPES,
    Instance,
    Scene,
    _shape_mask,
    prompt_for,
    render_scene,
    targets,
)
from metainfer.sam.tokenizer import PromptTokenizer


def scene_with_repeats(rng: np.random.Generator, size: int) -> Scene:
    """A size × size scene in which, 40 % of the time, one concept is drawn 1-2 more times (counts matter)."""
    scene = render_scene(rng, size, size)
    if rng.random() < 0.4 and scene.instances:
        inst = scene.instances[int(rng.integers(len(scene.instances)))]
        img = scene.image.astype(np.float32)
        extra = []
        for _ in range(int(rng.integers(1, 3))):
            small = inst.size == "small"
            r = size * (rng.uniform(0.07, 0.13) if small else rng.uniform(0.17, 0.26))
            cy, cx = rng.uniform(r * 0.6, size - r * 0.6), rng.uniform(r * 0.6, size - r * 0.6)
            m = _shape_mask(inst.shape, size, size, cy, cx, r, rng.uniform(0, 2 * np.pi))
            img[m] = np.array(COLOURS[inst.colour]) * rng.uniform(0.85, 1.1) + rng.normal(
                0, 6, (int(m.sum()), 3)
            )
            extra.append(Instance(inst.colour, inst.shape, inst.size, m))
        instances = []
        everything = scene.instances + extra
        for i, a in enumerate(everything):
            vis = a.mask.copy()
            for b in everything[i + 1 :]:
                vis &= ~b.mask
            if vis.sum() >= 0.5 * a.mask.sum():
                instances.append(Instance(a.colour, a.shape, a.size, vis))
        scene = Scene(np.clip(img, 0, 255).astype(np.uint8), instances)
    return scene


def sample_prompts(scene: Scene, rng: np.random.Generator) -> list[str]:
    """Two prompts: a present concept, then a present or (40 %) absent one."""
    out = []
    for k in range(2):
        if scene.instances and (k == 0 or rng.random() < 0.6):
            inst = scene.instances[int(rng.integers(len(scene.instances)))]
            out.append(prompt_for(inst, rng, plural=bool(rng.random() < 0.5)))
        else:
            present = {(i.colour, i.shape) for i in scene.instances}
            absent = [(c, s) for c in COLOURS for s in SHAPES if (c, s) not in present]
            c, s = absent[int(rng.integers(len(absent)))]
            out.append(f"{c} {s}" + ("s" if rng.random() < 0.5 else ""))
    return out


def match_ious(pred: np.ndarray, truth: list[np.ndarray]) -> np.ndarray:
    """pred [K, H, W] bool, truth: N masks -> [N] IoU of each truth with its Hungarian-matched prediction."""
    from scipy.optimize import linear_sum_assignment

    iou = np.zeros((len(pred), len(truth)))
    for a, pm in enumerate(pred):
        for b, tm in enumerate(truth):
            iou[a, b] = (pm & tm).sum() / max((pm | tm).sum(), 1)
    best = np.zeros(len(truth))
    if len(pred) and len(truth):
        r, c = linear_sum_assignment(-iou)
        best[c] = iou[r, c]
    return best


@torch.no_grad()
def evaluate(model: SamModel, tok: PromptTokenizer, seed: int, n_scenes: int, size: int) -> dict[str, float]:
    """Held-out scenes (seeded), each with one present-concept prompt."""
    was_training = model.training
    model.eval()
    rng = np.random.default_rng(seed)
    ious, exact = [], []
    for _ in range(n_scenes):
        scene = scene_with_repeats(rng, size)
        prompt = sample_prompts(scene, rng)[0]
        truth = targets(scene, prompt)
        ids, valid = tok.encode([prompt])
        p0 = next(model.parameters())
        out = model(
            preprocess(scene.image, model.config.image_size)[None].to(p0.device, p0.dtype), ids, valid
        )
        pred = postprocess(out, [(size, size)])[0].masks.cpu().numpy()
        exact.append(len(pred) == len(truth))
        ious.extend(match_ious(pred, truth).tolist())
    model.train(was_training)
    return {"mean_iou": float(np.mean(ious)), "count_exact": float(np.mean(exact)), "scenes": n_scenes}
