"""Weights: the map from checkpoint names to engine tensors, HF loading, and seeded dummy init.

Canonical names are those of transformers' `Qwen3_5MoeForCausalLM` (`model.layers.N...`,
`lm_head.weight`) plus `mtp.*`. Published checkpoints (`model.language_model.*`) are renamed on the
way in; `model.visual.*` is skipped. Engine parameters that stack several checkpoint tensors
(qkv, [qkv|z|b|a], router + shared-expert gate, shared gate/up) are filled slice by slice.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from metainfer.config import FULL, ModelConfig
from metainfer.model.fp8 import Fp8CheckpointLoader, prepare_fp8_storage, scales_to
from metainfer.model.layers import Linear
from metainfer.model.quant_config import CheckpointError, Fp8Scheme
from metainfer.model.qwen3_5_moe import DecoderLayer, Qwen3_5MoeModel


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor lands: a view of an engine parameter, and its checkpoint shape."""

    view: torch.Tensor
    hf_shape: tuple[int, ...]

    def hf_view(self) -> torch.Tensor:
        return self.view.view(self.hf_shape)


def _linear(targets: dict[str, Target], lin: Linear, names: dict[str, str]) -> None:
    """names: part -> checkpoint name of the tensor [rows, in] stacked at that part's rows."""
    for part, name in names.items():
        off, n = lin.row_offset(part)
        view = lin.weight.data[off : off + n]
        targets[name] = Target(view, (n, lin.in_features))


def _layer_targets(targets: dict[str, Target], layer: DecoderLayer, p: str, cfg: ModelConfig) -> None:
    targets[f"{p}.input_layernorm.weight"] = Target(layer.input_layernorm.weight.data, (cfg.hidden_size,))
    targets[f"{p}.post_attention_layernorm.weight"] = Target(
        layer.post_attention_layernorm.weight.data, (cfg.hidden_size,)
    )
    if layer.layer_type == FULL:
        a = layer.self_attn
        _linear(targets, a.qkv_proj, {x: f"{p}.self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj")})
        _linear(targets, a.o_proj, {"o_proj": f"{p}.self_attn.o_proj.weight"})
        targets[f"{p}.self_attn.q_norm.weight"] = Target(a.q_norm.weight.data, (cfg.head_dim,))
        targets[f"{p}.self_attn.k_norm.weight"] = Target(a.k_norm.weight.data, (cfg.head_dim,))
    else:
        d = layer.linear_attn
        q = f"{p}.linear_attn"
        _linear(
            targets,
            d.in_proj,
            {x: f"{q}.{x}.weight" for x in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")},
        )
        _linear(targets, d.out_proj, {"out_proj": f"{q}.out_proj.weight"})
        C, K = d.conv_weight.shape
        targets[f"{q}.conv1d.weight"] = Target(d.conv_weight.data, (C, 1, K))
        targets[f"{q}.A_log"] = Target(d.A_log.data, (d.hv,))
        targets[f"{q}.dt_bias"] = Target(d.dt_bias.data, (d.hv,))
        targets[f"{q}.norm.weight"] = Target(d.norm_weight.data, (d.dv,))
    m = layer.mlp
    _linear(
        targets,
        m.router,
        {"gate": f"{p}.mlp.gate.weight", "shared_expert_gate": f"{p}.mlp.shared_expert_gate.weight"},
    )
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    targets[f"{p}.mlp.experts.gate_up_proj"] = Target(m.w_gate_up.data[:E], (E, 2 * I, cfg.hidden_size))
    targets[f"{p}.mlp.experts.down_proj"] = Target(m.w_down.data[:E], (E, cfg.hidden_size, I))
    sp = f"{p}.mlp.shared_expert"
    if m.fused_shared:  # stored as expert E
        H = cfg.hidden_size
        targets[f"{sp}.gate_proj.weight"] = Target(m.w_gate_up.data[E, :I], (I, H))
        targets[f"{sp}.up_proj.weight"] = Target(m.w_gate_up.data[E, I:], (I, H))
        targets[f"{sp}.down_proj.weight"] = Target(m.w_down.data[E], (H, I))
    else:
        _linear(targets, m.shared_gate_up, {x: f"{sp}.{x}.weight" for x in ("gate_proj", "up_proj")})
        _linear(targets, m.shared_down, {"down_proj": f"{sp}.down_proj.weight"})


def param_targets(model: Qwen3_5MoeModel) -> dict[str, Target]:
    """Every canonical checkpoint name -> where it lands in `model`."""
    cfg = model.cfg
    t: dict[str, Target] = {
        "model.embed_tokens.weight": Target(
            model.embed_tokens.weight.data, (cfg.vocab_size, cfg.hidden_size)
        ),
        "model.norm.weight": Target(model.norm.weight.data, (cfg.hidden_size,)),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = Target(model.lm_head.weight.data, (cfg.vocab_size, cfg.hidden_size))
    for i, layer in enumerate(model.layers):
        _layer_targets(t, layer, f"model.layers.{i}", cfg)
    if model.mtp is not None:
        mtp, H = model.mtp, cfg.hidden_size
        _linear(t, mtp.fc, {"fc": "mtp.fc.weight"})
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            t[f"mtp.{n}.weight"] = Target(getattr(mtp, n).weight.data, (H,))
        _layer_targets(t, mtp.layers[0], "mtp.layers.0", cfg)
    return t


def canonical_name(name: str) -> str | None:
    """Checkpoint key -> canonical name; None for tensors the text model does not use."""
    if name.startswith(("model.visual.", "visual.")) or "rotary_emb" in name:
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


# ---- construction --------------------------------------------------------------------------------
def build_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, fp8: bool = False
) -> Qwen3_5MoeModel:
    """An uninitialised model allocated on `device` in `dtype` (no host round trip). fp8: the
    FP8-eligible weights allocated as e4m3 + fp32 scales from the start (for an FP8 checkpoint)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen3_5MoeModel(cfg)
    finally:
        torch.set_default_dtype(old)
    if fp8:
        prepare_fp8_storage(model)
    model = model.to_empty(device=device)
    if fp8:
        scales_to(model, device)
    for mod in model.modules():  # buffers computed, not loaded
        if hasattr(mod, "inv_freq"):
            from metainfer.kernels.ops import rope_inv_freq

            mod.inv_freq = rope_inv_freq(mod.inv_freq.numel() * 2, cfg.rope_theta).to(device)
    return model.eval()


# ---- HF safetensors ------------------------------------------------------------------------------
def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def load_checkpoint(
    model: Qwen3_5MoeModel, model_dir: Path, progress: bool = True, fp8: Fp8Scheme | None = None
) -> None:
    """Copies every checkpoint tensor into the model, shard by shard and tensor by tensor (safetensors
    maps each shard; the host holds the tensor in hand, not the model), with a progress bar in bytes
    on stderr. fp8: the checkpoint's FP8 scheme (`quant_config.read_scheme`); the model then holds
    e4m3 storage (`build_model(fp8=True)`): e4m3 weights and their `weight_scale_inv` are copied as
    they are, BF16 tensors bound for e4m3 storage are quantised by the engine's own quantiser (as
    online quantisation would), the rest is copied as is. Every error is a CheckpointError naming the
    tensor: missing, unexpected or misshapen tensors, e4m3 where the engine or the config keeps BF16."""
    from safetensors import safe_open
    from tqdm import tqdm

    targets = param_targets(model)
    per_expert = _per_expert_targets(model)
    loader = None
    if fp8 is not None:
        loader = Fp8CheckpointLoader(model, {n: t.view for n, t in {**targets, **per_expert}.items()})
    filled: set[str] = set()
    files = checkpoint_files(model_dir)
    bar = tqdm(total=sum(f.stat().st_size for f in files), desc="loading weights", unit="B",
               unit_scale=True, disable=not progress)
    try:
        for f in files:
            done = bar.n
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    name = canonical_name(key)
                    if name is None or (name.startswith("mtp.") and model.mtp is None):
                        continue
                    src = sf.get_tensor(key)
                    _place(key, name, src, targets, per_expert, loader, fp8, filled)
                    bar.update(src.numel() * src.element_size())
            bar.update(done + f.stat().st_size - bar.n)  # the header and the tensors skipped
        if loader is not None:
            loader.finish()
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None
    finally:
        bar.close()
    for fused, parts in _expert_groups(model).values():
        if all(p in filled for p in parts):
            filled.add(fused)
    missing = sorted(set(targets) - filled)
    if missing:
        raise CheckpointError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")


def _place(key: str, name: str, src: torch.Tensor, targets: dict[str, Target], per_expert: dict[str, Target],
           loader, fp8: Fp8Scheme | None, filled: set[str]) -> None:
    """One checkpoint tensor (`key`, canonical `name`) into the model; ValueError naming it."""
    e4m3 = src.dtype == torch.float8_e4m3fn
    module = name.removesuffix(".weight").removesuffix(".weight_scale_inv").removesuffix("_scale_inv")
    if e4m3 and fp8 is None:
        raise ValueError(f"{key} is float8_e4m3fn, but config.json declares no FP8 quantization_config")
    if e4m3 and fp8.keeps_unquantised(module):
        raise ValueError(
            f"{key} is float8_e4m3fn, but quantization_config lists {module} in modules_to_not_convert"
        )
    if loader is not None and loader.owns(name):
        loader.load_tensor(name, src)
        if not name.endswith("scale_inv"):
            filled.add(name)
        return
    if e4m3 or name.endswith("scale_inv"):
        raise ValueError(f"{key}: FP8 tensors for {module}, which the engine keeps unquantised")
    tgt = targets.get(name) or per_expert.get(name)
    if tgt is None:
        raise ValueError(f"unexpected checkpoint tensor {key!r}")
    if tuple(src.shape) != tgt.hf_shape:
        raise ValueError(f"{key}: checkpoint shape {tuple(src.shape)} != expected {tgt.hf_shape}")
    tgt.hf_view().copy_(src)
    filled.add(name)


def _per_expert_targets(model: Qwen3_5MoeModel) -> dict[str, Target]:
    """Unfused expert keys (`experts.{e}.gate_proj.weight` ...) -> slices of the fused tensors."""
    out: dict[str, Target] = {}
    cfg = model.cfg
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    for prefix, layer in _all_layers(model):
        m = layer.mlp
        for e in range(cfg.num_experts):
            p = f"{prefix}.mlp.experts.{e}"
            out[f"{p}.gate_proj.weight"] = Target(m.w_gate_up.data[e, :I], (I, H))
            out[f"{p}.up_proj.weight"] = Target(m.w_gate_up.data[e, I:], (I, H))
            out[f"{p}.down_proj.weight"] = Target(m.w_down.data[e], (H, I))
    return out


def _expert_groups(model: Qwen3_5MoeModel) -> dict[str, tuple[str, list[str]]]:
    groups = {}
    for prefix, _ in _all_layers(model):
        E = model.cfg.num_experts
        p = f"{prefix}.mlp.experts"
        groups[f"{p}.gate_up_proj"] = (
            f"{p}.gate_up_proj",
            [f"{p}.{e}.{x}.weight" for e in range(E) for x in ("gate_proj", "up_proj")],
        )
        groups[f"{p}.down_proj"] = (f"{p}.down_proj", [f"{p}.{e}.down_proj.weight" for e in range(E)])
    return groups


def _all_layers(model: Qwen3_5MoeModel) -> list[tuple[str, DecoderLayer]]:
    out = [(f"model.layers.{i}", layer) for i, layer in enumerate(model.layers)]
    if model.mtp is not None:
        out.append(("mtp.layers.0", model.mtp.layers[0]))
    return out


# ---- dummy weights -------------------------------------------------------------------------------
LM_HEAD_GAIN = 10.0  # logits std ~ LM_HEAD_GAIN: a peaked next-token distribution
ROUTER_GAIN = 2.0  # decisive routing
RESIDUAL_GAIN = 0.15  # residual writers scaled down: BF16/FP8 rounding is amplified less through 40 layers
RESIDUAL_WRITERS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


def dummy_init_(name: str, t: torch.Tensor, cfg: ModelConfig, gen: torch.Generator) -> None:
    """The one seeded dummy recipe, in canonical-name terms (the oracle restates it independently in
    metainfer/oracle/recipe.py).

    Projections ~ N(0, 1/fan_in) keep activations O(1) through 40 layers; the embedding ~ N(0, 1);
    lm_head ~ N(0, (LM_HEAD_GAIN^2)/H) makes logits peaked enough that the judge can see errors;
    norm weights are small perturbations; A_log follows transformers' init range and dt_bias Mamba's,
    so DeltaNet heads keep long memories and the output depends on the history, not only on the last token.
    """
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("embed_tokens.weight"):
        t.normal_(0.0, 1.0, generator=gen)
    elif name == "lm_head.weight":
        t.normal_(0.0, LM_HEAD_GAIN / math.sqrt(cfg.hidden_size), generator=gen)
    elif name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name.startswith(
        ("model.norm.", "mtp.norm.", "mtp.pre_fc_norm")
    ):
        t.uniform_(-0.1, 0.1, generator=gen)  # applied as (1 + w)
    elif name.endswith("linear_attn.norm.weight"):
        t.uniform_(0.9, 1.1, generator=gen)  # applied as w
    elif leaf == "A_log":
        t.copy_(torch.empty(t.shape, device=t.device).uniform_(1.0, 16.0, generator=gen).log_())
    elif leaf == "dt_bias":  # softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (Mamba): long memories
        dt = (
            torch.empty(t.shape, device=t.device)
            .uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
            .exp_()
        )
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


def init_dummy(model: Qwen3_5MoeModel, seed: int) -> None:
    """Fills every parameter in place; each tensor's values depend only on (seed, name, device)."""
    gen = torch.Generator(device=model.embed_tokens.weight.device)
    for name, tgt in param_targets(model).items():
        gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        view = tgt.hf_view()
        if view.is_contiguous():
            dummy_init_(name, view, model.cfg, gen)
        else:  # fill a temporary, then copy
            tmp = torch.empty(view.shape, dtype=view.dtype, device=view.device)
            dummy_init_(name, tmp, model.cfg, gen)
            view.copy_(tmp)


def hf_state_dict(model: Qwen3_5MoeModel, include_mtp: bool = False) -> dict[str, torch.Tensor]:
    """Canonical name -> view of the engine's storage in checkpoint shape (no copies)."""
    out = {n: t.hf_view() for n, t in param_targets(model).items() if include_mtp or not n.startswith("mtp.")}
    if model.cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
