"""Resolve a `--model` argument to a model and its tokenizer.

None: the embedded default model (metainfer/assets/sam_default); DIR: a checkpoint directory;
"dummy": seeded peaked weights of the released checkpoint's shape; "dummy:CONFIG": of the config.json at
CONFIG. Dummy models use the default model's tokenizer (its ids fit any vocabulary of that size or more).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from metainfer.sam.config import SamConfig
from metainfer.sam.model import SamModel
from metainfer.sam.tokenizer import PromptTokenizer

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "assets" / "sam_default"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelSpecError(ValueError):
    """A --model argument that cannot be resolved (usage error)."""


@dataclass
class Loaded:
    model: SamModel
    tokenizer: PromptTokenizer
    name: str  # what was loaded, for reports


def load(spec: str | None, device: str = "cpu", dtype: str = "float32", seed: int = 0) -> Loaded:
    from metainfer.sam.weights import dummy_model, load_checkpoint

    if dtype not in DTYPES:
        raise ModelSpecError(f"dtype {dtype!r} not in {sorted(DTYPES)}")
    dt = DTYPES[dtype]
    if spec is None or spec == "default":
        if not (DEFAULT_DIR / "model.safetensors").is_file():
            raise ModelSpecError(
                f"the default model is missing at {DEFAULT_DIR} (scripts/train_default_sam.py)"
            )
        model = load_checkpoint(DEFAULT_DIR, device, dt)
        tok_dir, name = DEFAULT_DIR, "default"
    elif spec == "dummy" or spec.startswith("dummy:"):
        cfg_path = spec.partition(":")[2]
        try:
            config = SamConfig.load(cfg_path) if cfg_path else SamConfig()
        except FileNotFoundError as e:
            raise ModelSpecError(str(e)) from None
        model = dummy_model(config, device, dt, seed)
        tok_dir, name = DEFAULT_DIR, f"dummy:{cfg_path or 'sam3'} seed={seed}"
    else:
        d = Path(spec)
        if not d.is_dir() or not (d / "config.json").is_file():
            raise ModelSpecError(f"--model {spec}: not a directory with a config.json")
        model = load_checkpoint(d, device, dt)
        tok_dir, name = d, str(d)
    try:
        tok = PromptTokenizer.from_dir(tok_dir, model.config.text_context)
    except FileNotFoundError as e:
        raise ModelSpecError(str(e)) from None
    if tok.vocab_size > model.config.vocab_size:
        raise ModelSpecError(
            f"tokenizer has {tok.vocab_size} ids, the model's vocabulary {model.config.vocab_size}"
        )
    return Loaded(model, tok, name)
