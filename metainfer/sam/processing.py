"""Pre- and postprocessing as transformers' Sam3 processor does them.

preprocess: RGB image -> [3, S, S] float: bilinear (antialiased) resize to S² ignoring the aspect ratio,
x/255, then (x - 0.5) / 0.5.
postprocess: score = sigmoid(logit) × sigmoid(presence); keep score > threshold; boxes (x0, y0, x1, y1)
scaled to pixels; only kept masks are upsampled (bilinear, on probabilities) to the image's size and
binarised at mask_threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from metainfer.sam.model import SamOutput

MEAN = STD = 0.5
MAX_SIDE = 16384  # larger images are refused, not resized
MAX_PIXELS = 100_000_000


def load_image(path: str | Path) -> np.ndarray:
    """[H, W, 3] uint8 RGB. ValueError for a missing, unreadable or absurdly sized image."""
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no such image: {p}")
    Image.MAX_IMAGE_PIXELS = MAX_PIXELS
    try:
        with Image.open(p) as im:
            w, h = im.size
            if w < 1 or h < 1 or w > MAX_SIDE or h > MAX_SIDE:
                raise ValueError(f"{p}: image size {w}×{h} out of range (1..{MAX_SIDE} per side)")
            return np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"{p}: not a readable image ({e.__class__.__name__})") from None


def preprocess(image: np.ndarray | torch.Tensor, size: int) -> torch.Tensor:
    """[H, W, 3] uint8 -> [3, size, size] float32."""
    x = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)[None].float()
    if x.shape[-2:] != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    return ((x[0] / 255.0) - MEAN) / STD


@dataclass
class Detections:
    """One (image, prompt) result at the image's own size."""

    query: torch.Tensor  # [K] kept query indices
    scores: torch.Tensor  # [K]
    boxes: torch.Tensor  # [K, 4] pixels (x0, y0, x1, y1)
    masks: torch.Tensor  # [K, H, W] bool


def postprocess(
    out: SamOutput, sizes: list[tuple[int, int]], threshold: float = 0.5, mask_threshold: float = 0.5
) -> list[Detections]:
    """One Detections per prompt row of `out`; sizes[p] = (H, W) of that prompt's image."""
    scores = out.scores().float()
    res = []
    for p, (h, w) in enumerate(sizes):
        keep = torch.nonzero(scores[p] > threshold).flatten()
        scale = torch.tensor([w, h, w, h], dtype=torch.float32, device=scores.device)
        boxes = out.boxes[p, keep].float() * scale
        if len(keep):
            probs = out.masks[p, keep].float().sigmoid()[None]
            masks = (
                F.interpolate(probs, size=(h, w), mode="bilinear", align_corners=False)[0] > mask_threshold
            )
        else:
            masks = torch.zeros(0, h, w, dtype=torch.bool, device=scores.device)
        res.append(Detections(keep, scores[p, keep], boxes, masks))
    return res


def rle_encode(masks: torch.Tensor) -> list[dict]:
    """[K, H, W] bool -> COCO RLE dicts {"size": [H, W], "counts": str} (pycocotools)."""
    from pycocotools import mask as mask_utils

    out = []
    for m in masks.cpu().numpy().astype(np.uint8):
        r = mask_utils.encode(np.asfortranarray(m))
        out.append({"size": [int(r["size"][0]), int(r["size"][1])], "counts": r["counts"].decode("ascii")})
    return out


def rle_decode(rle: dict) -> np.ndarray:
    from pycocotools import mask as mask_utils

    return mask_utils.decode({"size": rle["size"], "counts": rle["counts"].encode("ascii")}).astype(bool)
