"""Weights of the SAM 3 image model: a transformers-named safetensors checkpoint directory, or seeded dummy
weights built on the meta device and initialised on the target device.

Dummy weights are *peaked*: after a fan-in-scaled random init, a seeded calibration batch sets the
presence bias, the spread and offset of the query logits and the scale of the mask logits, so that about
`KEEP_FRACTION` of the queries clear a 0.5 score and mask logits are far from zero — the postprocessing's
thresholds then decide on signal, not on noise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from metainfer.sam.config import SamConfig
from metainfer.sam.model import SamModel, unused_key
from metainfer.sam.vision import VitLayer

KEEP_FRACTION = 0.10  # of all calibration queries whose score clears SCORE_THRESHOLD
SCORE_THRESHOLD = 0.5
PRESENCE_LOGIT = 3.0  # sigmoid ≈ 0.95
LOGIT_STD = 3.0  # prompt-dependent spread of the query logits
MASK_LOGIT_STD = 4.0
CHECKPOINT_PREFIXES = ("detector_model.",)  # a sam3_video checkpoint's image model


def init_buffers(model: SamModel, device: torch.device | str) -> None:
    for m in model.modules():
        if isinstance(m, VitLayer):
            m.init_buffers(torch.device(device))


def empty_model(config: SamConfig) -> SamModel:
    with torch.device("meta"):
        return SamModel(config)


def load_checkpoint(path: str | Path, device: str | torch.device, dtype: torch.dtype) -> SamModel:
    """A directory with config.json and *.safetensors named as transformers' Sam3Model (or
    Sam3VideoModel) names them."""
    from safetensors import safe_open

    d = Path(path)
    config = SamConfig.load(d)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    model = empty_model(config)
    names = set(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sf = safe_open(str(f), framework="pt", device=str(device))
        except Exception as e:  # the library's own error type: a corrupt or truncated file
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
        with sf:
            for key in sf.keys():
                name = key
                for p in CHECKPOINT_PREFIXES:
                    if name.startswith(p):
                        name = name[len(p) :]
                if name in names:
                    state[name] = sf.get_tensor(key).to(dtype)
                elif not unused_key(config, name):
                    raise ValueError(f"{f.name}: unexpected tensor {key!r}")
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    for name, t in state.items():
        if t.shape != shapes[name]:
            raise ValueError(
                f"{d}: {name} has shape {tuple(t.shape)}, its config implies {tuple(shapes[name])}"
            )
    missing = names - set(state)
    if missing:
        raise ValueError(f"{d}: missing tensors, e.g. {sorted(missing)[:5]}")
    model.load_state_dict(state, assign=True)
    init_buffers(model, device)
    return model.eval()


def _fill(model: SamModel, gen: torch.Generator) -> None:
    """Fan-in-scaled normal weights, small biases, unit norms; in a fixed (name) order."""
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        with torch.no_grad():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02, generator=gen)
            elif p.ndim == 1:  # norm weights
                p.normal_(1.0, 0.02, generator=gen)
            elif "embedding" in name or name.endswith(("query_embed.weight", "presence_token.weight")):
                p.normal_(0.0, 1.0 if "query_embed" in name or "presence" in name else 0.02, generator=gen)
            elif name.endswith("reference_points.weight"):
                p.normal_(0.0, 1.0, generator=gen)
            else:
                fan_in = p[0].numel() if "scale_layers" not in name else p.shape[0] * p[0, 0].numel()
                p.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)


def calibration_batch(config: SamConfig, device, dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Seeded synthetic scenes and random prompts:
    (pixel_values [4, 3, S, S], ids [8, T], valid [8, T], image_index [8])."""
    import numpy as np

    from metainfer.sam.processing import preprocess
    from metainfer.sam.scenes import render_scene

    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    rng = np.random.default_rng(seed + 1)
    s = config.image_size
    pixels = torch.stack([preprocess(render_scene(rng, 96, 96).image, s) for _ in range(4)])
    t = min(8, config.text_context)
    ids = torch.randint(0, config.vocab_size, (8, t), generator=gen)
    lengths = torch.randint(3, t + 1, (8,), generator=gen)
    valid = torch.arange(t)[None] < lengths[:, None]
    index = torch.arange(8) % 4
    return pixels.to(device, dtype), ids.to(device), valid.to(device), index.to(device)


@torch.no_grad()
def peak(model: SamModel, seed: int) -> None:
    """Sets the presence bias, query-logit spread and offset and mask-logit scale from a calibration batch."""
    p0 = next(model.parameters())
    batch = calibration_batch(model.config, p0.device, p0.dtype, seed)
    sc, dec = model.dot_product_scoring, model.detr_decoder
    out = model(*batch)
    dec.presence_head.layer3.bias += PRESENCE_LOGIT - out.presence_logits.float().mean()
    mk = model.mask_decoder.mask_embedder.layers[-1]
    k = MASK_LOGIT_STD / out.masks.float().std().clamp(min=1e-6)
    mk.weight *= k
    mk.bias *= k
    k = LOGIT_STD / out.logits.float().std().clamp(min=1e-6)
    sc.query_proj.weight *= k
    sc.query_proj.bias *= k
    # a shared direction u: text_proj gains sqrt(D)·u, query_proj gains gamma·u; logits move linearly in gamma
    gen = torch.Generator(device="cpu").manual_seed(seed + 2)
    u = torch.randn(model.config.hidden, generator=gen)
    u = (u / u.norm()).to(p0.device, p0.dtype)
    sc.text_proj.bias += math.sqrt(model.config.hidden) * u
    base = model(*batch)
    sc.query_proj.bias += u
    slope = model(*batch).logits.float() - base.logits.float()
    sc.query_proj.bias -= u
    # gamma such that KEEP_FRACTION of the calibration scores clear the threshold
    presence = base.presence_logits.float().sigmoid()
    target = torch.logit((SCORE_THRESHOLD / presence).clamp(max=0.999))  # [P, 1] logit needed
    lo, hi = -100.0, 100.0
    for _ in range(60):
        g = (lo + hi) / 2
        frac = ((base.logits.float() + g * slope) > target).float().mean().item()
        lo, hi = (g, hi) if frac < KEEP_FRACTION else (lo, g)
    sc.query_proj.bias += (lo + hi) / 2 * u


def dummy_model(
    config: SamConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> SamModel:
    """Seeded, peaked random weights: built on the meta device, materialised and filled on `device` (fp32
    for the init and calibration, then cast to `dtype`)."""
    model = empty_model(config).to_empty(device=device)
    init_buffers(model, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    _fill(model, gen)
    model.eval()
    peak(model, seed)
    model.to(dtype)
    init_buffers(model, device)
    return model


def save_checkpoint(model: SamModel, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """config.json (transformers' layout) + model.safetensors of the used tensors."""
    from safetensors.torch import save_file

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(model.config.to_hf(), indent=1) + "\n")
    state = {
        k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in model.state_dict().items()
    }
    save_file(state, str(d / "model.safetensors"))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
