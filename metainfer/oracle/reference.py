"""The reference: transformers' own `Qwen3_5MoeForCausalLM`, code this project does not write.

It shares nothing with the engine, not even the weights where memory allows. The configuration is
read from the model's config.json by transformers itself (not through the engine's `ModelConfig`),
and the forward is transformers' (sdpa attention, its MoE and gated-delta-rule implementations).
Three ways to get the weights:

- `Reference.from_recipe`: regenerated from the seeded dummy recipe (metainfer.oracle.recipe) on
  the device, independently of the engine;
- `Reference.from_pretrained`: transformers loads a checkpoint directory itself;
- `Reference.from_fp8_checkpoint`: an FP8 checkpoint, dequantised by the oracle
  (metainfer.oracle.fp8_checkpoint), the reference's weights being its dequantised values;
- `Reference.from_weights`: canonical-named tensors (`model.layers.N...`, `lm_head.weight`), e.g.
  views of the engine's tensors when a second copy does not fit: built on the meta device and
  assigned, never copied.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from metainfer.oracle.recipe import recipe_spec, recipe_state_dict, text_config


@dataclass(frozen=True)
class ReferenceInfo:
    implementation: str  # transformers class
    transformers_version: str
    # "recipe" (regenerated from the dummy recipe) | "checkpoint" (loaded by transformers) |
    # "shared" (the engine's tensors)
    weights: str
    dtype: str
    device: str
    attn_implementation: str
    experts_implementation: str

    def to_dict(self) -> dict:
        return asdict(self)


class Reference:
    """Teacher-forced logits of one sequence per call: `logits(ids)` -> [L, V] fp32."""

    def __init__(self, model: torch.nn.Module, info: ReferenceInfo) -> None:
        self.model = model.eval()
        self.info = info
        self.device = torch.device(info.device)

    @classmethod
    def from_recipe(
        cls,
        config_path: str | Path,
        seed: int,
        device: torch.device | str,
        dtype: torch.dtype,
        on_tensor: Callable[[str, torch.Tensor], None] | None = None,
    ) -> Reference:
        """Weights regenerated from the seeded dummy recipe on `device` in `dtype` (one full copy),
        each tensor passed to `on_tensor` as it is drawn."""
        sd = recipe_state_dict(recipe_spec(config_path), seed, device, dtype, on_tensor)
        return cls.from_weights(config_path, sd, source="recipe")

    @classmethod
    def from_weights(
        cls, config_path: str | Path, weights: Mapping[str, torch.Tensor], source: str = "shared"
    ) -> Reference:
        """Built on the meta device, then every parameter is assigned one of `weights` (no copy);
        the rotary buffers are computed on the weights' device. `source` labels them in the info."""
        import transformers
        from transformers import Qwen3_5MoeForCausalLM

        cfg = text_config(config_path)
        first = next(iter(weights.values()))
        device, dtype = first.device, first.dtype
        with torch.device("meta"):
            model = Qwen3_5MoeForCausalLM(cfg)
        sd = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        if cfg.tie_word_embeddings and "lm_head.weight" not in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
        if unexpected:
            raise ValueError(f"reference: weights the model does not have: {unexpected[:5]}")
        if missing:
            raise ValueError(f"reference: {len(missing)} weights missing, e.g. {missing[:5]}")
        _rebuild_rotary(model, cfg, device)
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:
            raise ValueError(f"reference: tensors still on the meta device: {left[:5]}")
        return cls(model, _info(model, transformers.__version__, source, dtype, device))

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, device: torch.device | str, dtype: torch.dtype
    ) -> Reference:
        """transformers loads the checkpoint itself; every weight must be found."""
        import transformers
        from transformers import Qwen3_5MoeForCausalLM

        cfg = text_config(Path(model_dir) / "config.json")
        device = torch.device(device)
        placed = device.type != "cpu" and importlib.util.find_spec("accelerate") is not None
        model, info = Qwen3_5MoeForCausalLM.from_pretrained(
            str(model_dir),
            config=cfg,
            dtype=dtype,
            output_loading_info=True,
            **({"device_map": str(device)} if placed else {}),
        )
        missing = [m for m in info.get("missing_keys", []) if "rotary" not in m]
        if missing:
            raise ValueError(
                f"reference: checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:5]}"
            )
        if not placed:
            model = model.to(device)
        return cls(model, _info(model, transformers.__version__, "checkpoint", dtype, torch.device(device)))

    @classmethod
    def from_fp8_checkpoint(
        cls,
        model_dir: str | Path,
        device: torch.device | str,
        dtype: torch.dtype,
        on_e4m3: Callable[[str, torch.Tensor], None] | None = None,
    ) -> Reference:
        """The weights of an FP8 checkpoint dequantised (e4m3 x weight_scale_inv per 128 x 128 block)
        into `dtype` on `device`; on_e4m3 sees each stored e4m3 tensor
        (`fp8_checkpoint.dequantised_weights`)."""
        from metainfer.oracle.fp8_checkpoint import dequantised_weights

        config_path = Path(model_dir) / "config.json"
        cfg = text_config(config_path)
        sd = dequantised_weights(Path(model_dir), torch.device(device), dtype, cfg.num_experts, on_e4m3)
        return cls.from_weights(config_path, sd, source="checkpoint-dequantised")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The reference's weights by canonical name (tied lm_head included; no rotary buffers)."""
        return dict(self.model.named_parameters(remove_duplicate=False))

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """[L, V] fp32 on the reference's device; row i predicts token i + 1. A float32 reference
        computes in float32 (no TF32 matmuls or convolutions on CUDA)."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        with _no_tf32():
            out = self.model(input_ids=ids, use_cache=False)
        return out.logits[0].float()


@contextmanager
def _no_tf32() -> Iterator[None]:
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def _rebuild_rotary(model: torch.nn.Module, cfg, device: torch.device) -> None:
    """Rotary embeddings hold computed (non-persistent) buffers: construct them on `device`."""
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if "RotaryEmbedding" in type(child).__name__:
                with torch.device(device):
                    setattr(parent, name, type(child)(cfg))


def _info(model, version: str, weights: str, dtype: torch.dtype, device: torch.device) -> ReferenceInfo:
    c = model.config
    return ReferenceInfo(
        implementation=f"transformers.{type(model).__name__}",
        transformers_version=version,
        weights=weights,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        attn_implementation=str(getattr(c, "_attn_implementation", None)),
        experts_implementation=str(getattr(c, "_experts_implementation", None)),
    )
