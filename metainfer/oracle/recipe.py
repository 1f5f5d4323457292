"""The seeded dummy-weight recipe (`--load-format dummy`), stated by the oracle itself.

This is the published specification of the engine's dummy weights, restated here on purpose (the
engine's statement is `dummy_init_` / `init_dummy` in metainfer/model/weights.py): the reference
regenerates its weights from this module instead of reading the engine's tensors, so an engine that
changes a weight is judged against the weights it should have. It imports nothing of the engine
(metainfer.model, metainfer.engine, metainfer.kernels); the names and shapes come from transformers'
`Qwen3_5MoeForCausalLM` built on the meta device.

Contract, for every canonical tensor name of that model (`mtp.*` excluded; with
`tie_word_embeddings`, lm_head.weight *is* model.embed_tokens.weight and is not drawn):

- a `torch.Generator` on the target device, seeded with (seed * 1_000_003 + crc32(name)) % 2**63;
- a fresh contiguous tensor of the checkpoint shape in the target dtype, filled by `fill_`.

Same (seed, device, dtype) => bit-identical to the engine's tensor. CUDA Philox draws depend on the
shape, dtype and device of the tensor filled, which is why the tensor is the checkpoint's shape and
the engine's dtype, as the engine fills it.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

LM_HEAD_GAIN = 10.0  # logits std ~ 10: a peaked next-token distribution the judge can see through
ROUTER_GAIN = 2.0  # decisive routing
RESIDUAL_GAIN = 0.15  # residual writers scaled down: less rounding amplification over 40 layers
RESIDUAL_WRITERS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")
SEED_MUL = 1_000_003


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of canonical tensor `name` under weights seed `seed`."""
    return (seed * SEED_MUL + zlib.crc32(name.encode())) % (2**63)


def fill_(name: str, t: torch.Tensor, hidden_size: int, gen: torch.Generator) -> None:
    """Fills `t` (contiguous, checkpoint shape, target dtype) in place with the values of `name`.

    Projections ~ N(0, 1/fan_in) (fan_in = last dim); embedding ~ N(0, 1); lm_head ~
    N(0, LM_HEAD_GAIN^2 / hidden_size); residual writers ~ N(0, RESIDUAL_GAIN^2 / fan_in); router ~
    N(0, ROUTER_GAIN^2 / fan_in); conv1d ~ N(0, 1/K); norms applied as (1 + w) ~ U(-0.1, 0.1); the
    DeltaNet output norm ~ U(0.9, 1.1); A_log = log U(1, 16) and dt_bias = softplus^-1(dt) with dt
    log-uniform in [1e-3, 0.1], both drawn in float32 and then cast.
    """
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("embed_tokens.weight"):
        t.normal_(0.0, 1.0, generator=gen)
    elif name == "lm_head.weight":
        t.normal_(0.0, LM_HEAD_GAIN / math.sqrt(hidden_size), generator=gen)
    elif name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name.startswith(
        ("model.norm.", "mtp.norm.", "mtp.pre_fc_norm")
    ):
        t.uniform_(-0.1, 0.1, generator=gen)
    elif name.endswith("linear_attn.norm.weight"):
        t.uniform_(0.9, 1.1, generator=gen)
    elif leaf == "A_log":
        a = torch.empty(t.shape, dtype=torch.float32, device=t.device)
        t.copy_(a.uniform_(1.0, 16.0, generator=gen).log_())
    elif leaf == "dt_bias":
        dt = torch.empty(t.shape, dtype=torch.float32, device=t.device)
        dt.uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp_()
        t.copy_(dt + torch.log(-torch.expm1(-dt)))
    elif name.endswith("conv1d.weight"):
        t.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=gen)
    elif name.endswith("mlp.gate.weight"):
        t.normal_(0.0, ROUTER_GAIN / math.sqrt(t.shape[-1]), generator=gen)
    elif name.endswith(RESIDUAL_WRITERS):
        t.normal_(0.0, RESIDUAL_GAIN / math.sqrt(t.shape[-1]), generator=gen)
    elif t.dim() >= 2:
        t.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=gen)
    else:
        raise ValueError(f"no dummy recipe for {name}")


@dataclass(frozen=True)
class RecipeSpec:
    """What the recipe draws for one model config: canonical name -> checkpoint shape, in the
    reference's parameter order. `tied`: lm_head.weight is model.embed_tokens.weight (not drawn)."""

    shapes: dict[str, tuple[int, ...]]
    hidden_size: int
    tied: bool

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of every drawn tensor in `dtype` (the size of one regenerated copy)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(math.prod(s) * size for s in self.shapes.values())


def text_config(config_path: str | Path):
    """transformers' `Qwen3_5MoeTextConfig` from a config.json (nested `text_config` or flat)."""
    from transformers import Qwen3_5MoeTextConfig

    raw = json.loads(Path(config_path).read_text())
    text = dict(raw["text_config"]) if "text_config" in raw else dict(raw)
    text.pop("architectures", None)
    text["model_type"] = "qwen3_5_moe_text"
    return Qwen3_5MoeTextConfig.from_dict(text)


def recipe_spec(config_path: str | Path) -> RecipeSpec:
    """Names and shapes of transformers' `Qwen3_5MoeForCausalLM` for `config_path` (meta device)."""
    from transformers import Qwen3_5MoeForCausalLM

    cfg = text_config(config_path)
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(cfg)
    tied = bool(cfg.tie_word_embeddings)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name.startswith("mtp.") or (tied and name == "lm_head.weight"):
            continue
        shapes[name] = tuple(p.shape)
    return RecipeSpec(shapes, int(cfg.hidden_size), tied)


def regenerate(
    spec: RecipeSpec, name: str, seed: int, device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    """The recipe's tensor `name` on `device` in `dtype`: a fresh contiguous [checkpoint shape]."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name))
    t = torch.empty(spec.shapes[name], dtype=dtype, device=device)
    fill_(name, t, spec.hidden_size, gen)
    return t


def iter_recipe(
    spec: RecipeSpec, seed: int, device: torch.device | str, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every drawn tensor, one at a time (the caller decides what to keep)."""
    for name in spec.shapes:
        yield name, regenerate(spec, name, seed, device, dtype)


def recipe_state_dict(
    spec: RecipeSpec,
    seed: int,
    device: torch.device | str,
    dtype: torch.dtype,
    on_tensor: Callable[[str, torch.Tensor], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Every canonical tensor (lm_head aliased to the embedding when tied), each passed to
    `on_tensor` as it is drawn (e.g. to digest it). One full copy of the model on `device`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in iter_recipe(spec, seed, device, dtype):
        if on_tensor is not None:
            on_tensor(name, t)
        out[name] = t
    if spec.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
