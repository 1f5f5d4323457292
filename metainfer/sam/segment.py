"""Segmentation of images by text prompts with a loaded model: batching, overlays and the JSON document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from metainfer.sam.build import Loaded
from metainfer.sam.processing import Detections, postprocess, preprocess, rle_encode

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
PALETTE = np.array(
    [(255, 64, 64), (64, 200, 255), (255, 210, 0), (160, 80, 255), (0, 220, 120), (255, 128, 0)],
    dtype=np.float32,
)


def image_paths(arg: str) -> list[Path]:
    """A file, or the image files of a directory (sorted). ValueError if none."""
    p = Path(arg)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file())
        if not files:
            raise ValueError(f"no images in directory {p}")
        return files
    if not p.exists():
        raise ValueError(f"no such image: {p}")
    return [p]


@torch.no_grad()
def segment(
    loaded: Loaded,
    images: list[np.ndarray],
    prompts: list[str],
    threshold: float = 0.5,
    mask_threshold: float = 0.5,
) -> list[list[Detections]]:
    """result[i][j]: image i, prompt j. Each image's vision features are computed once for all prompts."""
    model, tok = loaded.model, loaded.tokenizer
    p0 = next(model.parameters())
    ids, valid = (t.to(p0.device) for t in tok.encode(prompts))
    out = []
    for img in images:
        pixels = preprocess(img, model.config.image_size)[None].to(p0.device, p0.dtype)
        index = torch.zeros(len(prompts), dtype=torch.long, device=p0.device)
        res = model(pixels, ids, valid, index)
        out.append(postprocess(res, [img.shape[:2]] * len(prompts), threshold, mask_threshold))
    return out


def overlay(image: np.ndarray, det: Detections) -> np.ndarray:
    """The image with each kept mask tinted in its own colour and its box outlined: [H, W, 3] uint8."""
    img = image.astype(np.float32).copy()
    h, w = img.shape[:2]
    for k, m in enumerate(det.masks.cpu().numpy()):
        c = PALETTE[k % len(PALETTE)]
        img[m] = 0.45 * img[m] + 0.55 * c
        x0, y0, x1, y1 = (int(round(v)) for v in det.boxes[k].tolist())
        x0, x1 = max(0, min(x0, w - 1)), max(0, min(x1, w - 1))
        y0, y1 = max(0, min(y0, h - 1)), max(0, min(y1, h - 1))
        img[y0 : y1 + 1, [x0, x1]] = c
        img[[y0, y1], x0 : x1 + 1] = c
    return img.clip(0, 255).astype(np.uint8)


def slug(text: str) -> str:
    s = "".join(ch if ch.isalnum() else "_" for ch in text.lower()).strip("_")
    return s[:40] or "prompt"


def detections_json(det: Detections) -> list[dict[str, Any]]:
    rles = rle_encode(det.masks)
    return [
        {"score": round(float(s), 6), "box": [round(float(v), 2) for v in b], "mask": r}
        for s, b, r in zip(det.scores.tolist(), det.boxes.tolist(), rles)
    ]


def save_overlay(path: Path, image: np.ndarray, det: Detections) -> None:
    from PIL import Image

    Image.fromarray(overlay(image, det)).save(path)
