"""Writing an engine model's weights (e.g. its seeded dummy weights) as a checkpoint in the published
layout, for load tests at full size where the real checkpoints cannot be fetched.

Both layouts: text tensors under `model.language_model.`, `lm_head.weight`, the MTP layer under
`mtp.`; shards `model-0000N-of-0000M.safetensors` of at most `shard_bytes` each plus
`model.safetensors.index.json`; config.json (and the tokenizer files beside the source config).
No vision tower (the engine has none).

- "bf16": the BF16 release: every tensor in the model's dtype, routed experts fused
  (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
- "fp8": the FP8 release (quant_config's format): q/k/v/o, in_proj_qkv, in_proj_z, out_proj, the
  shared expert and the routed experts, stored per expert (`mlp.experts.{e}.gate_proj/up_proj/
  down_proj`), as e4m3 `weight` + `weight_scale_inv`, each checkpoint tensor quantised alone by the
  engine's own quantiser (`fp8.quantize_fp8_block`), so that loading them back gives the bytes online
  quantisation gives wherever a tensor's rows start on a 128-row block of the engine's stacked
  matrix (all of them at the real model's sizes). The rest (embedding, norms, router, shared-expert
  gate, DeltaNet conv1d/A_log/dt_bias/in_proj_a/in_proj_b/norm, lm_head, mtp.fc) in the model's
  dtype, named in `quantization_config.modules_to_not_convert`. `scale_dtype`: float32 (the engine's
  scales, bit for bit) or bfloat16 (the dtype Qwen's FP8 releases store; the scales rounded).

The host holds one shard's tensors at a time; quantisation runs on the model's device.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from metainfer.model.fp8 import BLOCK, _cdiv, _quantize_chunked
from metainfer.model.qwen3_5_moe import Qwen3_5MoeModel
from metainfer.model.weights import hf_state_dict

PREFIX = "model.language_model."
# checkpoint modules the FP8 release stores in e4m3 (suffixes of the module name)
FP8_MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.out_proj",
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
)
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja")


def checkpoint_key(name: str) -> str:
    """Canonical name (`model.layers...`) -> the published checkpoint's key."""
    return PREFIX + name[len("model.") :] if name.startswith("model.") else name


@dataclass(frozen=True)
class _Item:
    """One checkpoint tensor: its key, size in bytes, and how to make it (on the model's device)."""

    key: str
    nbytes: int
    make: Callable[[], torch.Tensor]


class _Quantised:
    """quantize_fp8_block of one source tensor, made once and kept while consecutive items read it."""

    def __init__(self) -> None:
        self._src: torch.Tensor | None = None
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._src is not src:
            self._src, self._out = src, _quantize_chunked(src.contiguous(), 16)
        return self._out


def _items(model: Qwen3_5MoeModel, fmt: str, scale_dtype: torch.dtype) -> Iterator[_Item]:
    """The checkpoint's tensors in order (the canonical order of `hf_state_dict`)."""
    tensors = hf_state_dict(model, include_mtp=True)
    if model.cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    quant = _Quantised()
    scale_bytes = torch.empty((), dtype=scale_dtype).element_size()

    def fp8_pair(key: str, src: torch.Tensor, pick: Callable[[torch.Tensor], torch.Tensor]
                 ) -> Iterator[_Item]:
        *_, n, k = pick(src).shape
        yield _Item(f"{key}.weight", n * k, lambda: pick(quant(src)[0]))
        yield _Item(f"{key}.weight_scale_inv", _cdiv(n, BLOCK) * _cdiv(k, BLOCK) * scale_bytes,
                    lambda: pick(quant(src)[1]).to(scale_dtype))

    for name, t in tensors.items():
        key = checkpoint_key(name)
        if fmt == "fp8" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base = key.rsplit(".", 1)[0]
            if name.endswith("gate_up_proj"):
                inter = t.shape[1] // 2
                parts = {"gate_proj": t[:, :inter], "up_proj": t[:, inter:]}
            else:
                parts = {"down_proj": t}
            for part, src in parts.items():
                for e in range(t.shape[0]):
                    yield from fp8_pair(f"{base}.{e}.{part}", src, lambda x, e=e: x[e])
        elif fmt == "fp8" and name.removesuffix(".weight").endswith(FP8_MODULES):
            yield from fp8_pair(key.removesuffix(".weight"), t, lambda x: x)
        else:
            yield _Item(key, t.numel() * t.element_size(), lambda t=t: t)


def _shards(items: list[_Item], shard_bytes: int) -> list[list[_Item]]:
    shards: list[list[_Item]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards


def quantization_config(keys: list[str]) -> dict:
    """The FP8 release's quantization_config; modules_to_not_convert: every module written unquantised
    but the embedding and the final norm (which no FP8 method converts), as Qwen's FP8 configs list them."""
    fp8 = {k.removesuffix(".weight_scale_inv") for k in keys if k.endswith(".weight_scale_inv")}
    kept = []
    for k in keys:
        module = k.removesuffix(".weight")
        if module not in fp8 and not k.endswith(".weight_scale_inv") and module not in kept:
            if module not in (PREFIX + "embed_tokens", PREFIX + "norm"):
                kept.append(module)
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "modules_to_not_convert": kept,
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }


def checkpoint_nbytes(
    model: Qwen3_5MoeModel, fmt: str = "fp8", scale_dtype: torch.dtype = torch.float32
) -> int:
    """Bytes of tensor data `write_checkpoint` would write (nothing is quantised to count them)."""
    return sum(it.nbytes for it in _items(model, fmt, scale_dtype))


@torch.no_grad()
def write_checkpoint(
    model: Qwen3_5MoeModel,
    config_path: Path,
    out_dir: Path,
    fmt: str = "fp8",
    shard_bytes: int = 5 * 10**9,
    scale_dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> list[Path]:
    """Writes `model` (unquantised) to `out_dir` in the published `fmt` layout ("fp8" | "bf16"), with
    config.json from `config_path` (plus quantization_config for fp8). Returns the shard paths."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    if fmt not in ("fp8", "bf16"):
        raise ValueError(f"fmt must be fp8 or bf16, got {fmt!r}")
    if scale_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"scale_dtype must be float32 or bfloat16, got {scale_dtype}")
    if any(p.dtype == torch.float8_e4m3fn for p in model.parameters()):
        raise ValueError("write_checkpoint takes an unquantised model (it quantises what it writes)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [*out_dir.glob("*.safetensors"), out_dir / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    items = list(_items(model, fmt, scale_dtype))
    shards = _shards(items, shard_bytes)
    total = sum(it.nbytes for it in items)
    bar = tqdm(total=total, desc=f"writing {fmt} checkpoint", unit="B", unit_scale=True, disable=not progress)
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        path = out_dir / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        host = {}
        for it in shard:
            host[it.key] = it.make().contiguous().cpu()
            weight_map[it.key] = path.name
            bar.update(it.nbytes)
        save_file(host, str(path), metadata={"format": "pt"})
        del host
        paths.append(path)
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads(Path(config_path).read_text())
    config.pop("quantization_config", None)
    if fmt == "fp8":
        config["quantization_config"] = quantization_config([it.key for it in items])
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        src = Path(config_path).parent / name
        if src.is_file() and src.resolve() != (out_dir / name).resolve():
            shutil.copyfile(src, out_dir / name)
    return paths


def dummy_model(config_path: Path, seed: int, device: str, dtype: torch.dtype) -> Qwen3_5MoeModel:
    """The engine's seeded dummy model for `config_path` (what `--load-format dummy` serves)."""
    from metainfer.config import ModelConfig
    from metainfer.model.weights import build_model, init_dummy

    model = build_model(ModelConfig.from_hf(config_path), dtype, device)
    init_dummy(model, seed)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m metainfer.model.export",
        description="Writes the engine's seeded dummy weights as a checkpoint in the published BF16 or "
        "FP8 layout (for load tests where the real checkpoints cannot be fetched).",
    )
    p.add_argument("--config", required=True, help="config.json (or a model dir holding one)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", default="fp8", choices=["fp8", "bf16"], help="layout (default: fp8)")
    p.add_argument("--seed", type=int, default=0, help="dummy weights seed, as --engine-seed (default: 0)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the weights are made and quantised (default: cuda if present)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="the unquantised tensors' dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--shard-size", type=float, default=5.0, help="GB per shard (default: 5)")
    p.add_argument("--scale-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weight_scale_inv dtype (default: float32, the engine's own scales)")
    a = p.parse_args(argv)
    cfg = Path(a.config)
    cfg = cfg / "config.json" if cfg.is_dir() else cfg
    if not cfg.is_file():
        print(f"error: config not found: {cfg}", file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"))
    model = dummy_model(cfg, a.seed, a.device, dtype)
    paths = write_checkpoint(model, cfg, Path(a.out), a.format, int(a.shard_size * 1e9),
                             getattr(torch, a.scale_dtype))
    print(f"wrote {len(paths)} shards to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
