"""Synthetic scenes of coloured shapes: the default model's training data and the oracle's test images.

A scene is an RGB image on a textured background with overlapping instances (later ones occlude earlier
ones) and each instance's visible mask. Prompts name a concept: "[small|large] <colour> <shape>[s]".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COLOURS = {
    "red": (215, 40, 35),
    "green": (40, 170, 60),
    "blue": (35, 75, 215),
    "yellow": (235, 205, 35),
}
SHAPES = ("circle", "square", "triangle")
SIZES = ("small", "large")
SMALL_MAX = 0.13  # an instance is "small" when its radius is at most this fraction of the shorter side


@dataclass
class Instance:
    colour: str
    shape: str
    size: str
    mask: np.ndarray  # [H, W] bool, visible part


@dataclass
class Scene:
    image: np.ndarray  # [H, W, 3] uint8
    instances: list[Instance]


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Grey-brown texture: a smooth random field plus stripes or checks, never a shape colour."""
    base = rng.uniform(90, 170, size=3)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    coarse = rng.normal(0, 1, size=(6, 6, 1))
    field = np.kron(coarse, np.ones((int(np.ceil(h / 6)), int(np.ceil(w / 6)), 1)))[:h, :w]
    kind = rng.integers(3)
    period = rng.uniform(6, 20)
    if kind == 0:
        pattern = np.sin((xx * np.cos(rng.uniform(0, 3.14)) + yy * np.sin(rng.uniform(0, 3.14))) / period)
    elif kind == 1:
        pattern = np.sign(np.sin(xx / period) * np.sin(yy / period))
    else:
        pattern = rng.normal(0, 0.5, size=(h, w))
    img = base + 14 * field + 12 * pattern[..., None] * rng.uniform(0.3, 1.0)
    return img


def _shape_mask(shape: str, h: int, w: int, cy: float, cx: float, r: float, angle: float) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    dy, dx = yy - cy, xx - cx
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    c, s = np.cos(angle), np.sin(angle)
    u, v = c * dx + s * dy, -s * dx + c * dy
    if shape == "square":
        half = r * 0.85
        return (np.abs(u) <= half) & (np.abs(v) <= half)
    # triangle: equilateral, circumradius r
    inside = np.ones((h, w), dtype=bool)
    for k in range(3):
        a = angle + np.pi / 2 + k * 2 * np.pi / 3
        nx, ny = np.cos(a), np.sin(a)
        inside &= dx * nx + dy * ny <= r * 0.5
    return inside


def render_scene(
    rng: np.random.Generator, h: int, w: int, n_objects: int | None = None, min_visible: float = 0.5
) -> Scene:
    """A scene of 1-6 instances (n_objects if given); instances mostly hidden by later ones are dropped."""
    n = int(rng.integers(1, 7)) if n_objects is None else n_objects
    img = _background(rng, h, w)
    side = min(h, w)
    drawn: list[tuple[str, str, str, np.ndarray]] = []
    for _ in range(n):
        colour = str(rng.choice(list(COLOURS)))
        shape = str(rng.choice(SHAPES))
        size = str(rng.choice(SIZES))
        r = side * (rng.uniform(0.07, SMALL_MAX) if size == "small" else rng.uniform(0.17, 0.26))
        cy, cx = rng.uniform(r * 0.6, h - r * 0.6), rng.uniform(r * 0.6, w - r * 0.6)
        m = _shape_mask(shape, h, w, cy, cx, r, rng.uniform(0, 2 * np.pi))
        if not m.any():
            continue
        shade = np.array(COLOURS[colour], dtype=np.float32) * rng.uniform(0.85, 1.1)
        img[m] = shade + rng.normal(0, 6, size=(int(m.sum()), 3))
        drawn.append((colour, shape, size, m))
    instances = []
    for i, (colour, shape, size, m) in enumerate(drawn):
        vis = m.copy()
        for _, _, _, later in drawn[i + 1 :]:
            vis &= ~later
        if vis.sum() >= min_visible * m.sum():
            instances.append(Instance(colour, shape, size, vis))
    return Scene(np.clip(img, 0, 255).astype(np.uint8), instances)


def parse_prompt(prompt: str) -> tuple[str | None, str | None, str | None]:
    """(size, colour, shape) named by a prompt; None where it names none."""
    size = colour = shape = None
    for word in prompt.lower().split():
        word = word.rstrip("s") if word.rstrip("s") in SHAPES else word
        if word in SIZES:
            size = word
        elif word in COLOURS:
            colour = word
        elif word in SHAPES:
            shape = word
    return size, colour, shape


def targets(scene: Scene, prompt: str) -> list[np.ndarray]:
    """Visible masks of the instances a prompt names."""
    size, colour, shape = parse_prompt(prompt)
    return [
        i.mask
        for i in scene.instances
        if (size is None or i.size == size)
        and (colour is None or i.colour == colour)
        and (shape is None or i.shape == shape)
    ]


def prompt_for(instance: Instance, rng: np.random.Generator, plural: bool = False) -> str:
    """A prompt naming the instance's concept, with or without its size."""
    words = [instance.colour, instance.shape + ("s" if plural else "")]
    if rng.random() < 0.3:
        words.insert(0, instance.size)
    return " ".join(words)


def all_prompts() -> list[str]:
    """Every prompt the grammar makes (the tokenizer's training text)."""
    out = []
    for size in ("", *SIZES):
        for colour in COLOURS:
            for shape in SHAPES:
                for plural in ("", "s"):
                    out.append(f"{size} {colour} {shape}{plural}".strip())
    return out


def place(
    scene_image: np.ndarray, instances: list[Instance], rng: np.random.Generator, colour: str, shape: str,
    size: str, cy: float, cx: float, r: float,
) -> None:  # fmt: skip
    """Draw one instance at (cy, cx) with radius r over the image; earlier instances lose what it covers."""
    h, w = scene_image.shape[:2]
    m = _shape_mask(shape, h, w, cy, cx, r, rng.uniform(0, 2 * np.pi))
    scene_image[m] = np.clip(np.array(COLOURS[colour]) + rng.normal(0, 6, size=(int(m.sum()), 3)), 0, 255)
    for inst in instances:
        inst.mask &= ~m
    instances.append(Instance(colour, shape, size, m))


def demo_scene(h: int = 240, w: int = 320) -> Scene:
    """A fixed scene: two red circles, a blue square, a small green triangle, a yellow circle."""
    rng = np.random.default_rng(2024)
    img = np.clip(_background(rng, h, w), 0, 255).astype(np.uint8)
    inst: list[Instance] = []
    side = min(h, w)
    for colour, shape, size, fy, fx, fr in [
        ("red", "circle", "large", 0.30, 0.22, 0.20),
        ("blue", "square", "large", 0.68, 0.50, 0.19),
        ("red", "circle", "small", 0.75, 0.85, 0.11),
        ("green", "triangle", "small", 0.25, 0.62, 0.12),
        ("yellow", "circle", "small", 0.30, 0.86, 0.10),
    ]:
        place(img, inst, rng, colour, shape, size, fy * h, fx * w, fr * side)
    return Scene(img, inst)


if __name__ == "__main__":  # python -m metainfer.sam.scenes demo.png: writes the demo scene
    import sys

    from PIL import Image

    Image.fromarray(demo_scene().image).save(sys.argv[1] if len(sys.argv) > 1 else "demo.png")
