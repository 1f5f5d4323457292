"""A checkpoint's `quantization_config`: the published FP8 format, validated once, and the engine's
quantization resolved from it.

Qwen's FP8 checkpoints (Qwen3-Next-80B-A3B-Instruct-FP8, Qwen3.5/3.6-35B-A3B-FP8) declare in
config.json

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

and store each quantised projection `X` as `X.weight` (float8_e4m3fn, [N, K]) and
`X.weight_scale_inv` ([ceil(N/128), ceil(K/128)], BF16 or float32), with
W = weight * weight_scale_inv in each 128 x 128 block: the convention of the engine's own quantiser
(`fp8.quantize_fp8_block`), so scales are copied (widened to float32), never inverted. Routed experts
are stored per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj`). The modules the config lists
(router, shared-expert gate, norms, DeltaNet conv1d/A_log/dt_bias/in_proj_a/in_proj_b/norm, lm_head,
mtp.fc) and the embedding stay BF16. Anything else (other block sizes, static activation scales,
other formats or methods) is refused with a `CheckpointError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

BLOCK = (128, 128)
_SUPPORTED = "quant_method fp8, fmt e4m3, activation_scheme dynamic, weight_block_size [128, 128]"


class CheckpointError(ValueError):
    """A checkpoint the engine cannot load as asked; the message is one line naming the cause."""


@dataclass(frozen=True)
class Fp8Scheme:
    """A validated FP8 `quantization_config`. not_converted: canonical module names the checkpoint
    keeps unquantised (`model.language_model.` spelled `model.`)."""

    not_converted: tuple[str, ...] = ()

    @cached_property
    def _listed(self) -> frozenset[str]:
        return frozenset(self.not_converted)

    def keeps_unquantised(self, module: str) -> bool:
        """Whether `module` (canonical, e.g. `model.layers.0.mlp.gate`), a module holding it, or its
        last dotted parts (a short entry such as `lm_head` or `mlp.gate`) is listed."""
        parts = module.split(".")
        return any(".".join(parts[:i]) in self._listed or ".".join(parts[-i:]) in self._listed
                   for i in range(1, len(parts) + 1))


def _canonical_module(name: str) -> str:
    prefix = "model.language_model."
    return "model." + name[len(prefix) :] if name.startswith(prefix) else name


def read_scheme(config_path: Path) -> Fp8Scheme | None:
    """The FP8 scheme config.json declares (top level, or in text_config); None when it declares no
    quantization. Raises CheckpointError for a quantization the engine cannot load."""
    raw = json.loads(Path(config_path).read_text())
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    where = f"{config_path}: quantization_config"
    method = str(qc.get("quant_method", "")).lower()
    if method != "fp8":
        raise CheckpointError(
            f"{where}: unsupported quant_method {method or None!r} (supported: {_SUPPORTED})"
        )
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise CheckpointError(f"{where}: unsupported fmt {fmt!r} (supported: {_SUPPORTED})")
    act = str(qc.get("activation_scheme", "dynamic")).lower()
    if act != "dynamic":
        raise CheckpointError(
            f"{where}: activation_scheme {act!r} is not supported: the engine computes activation scales "
            "per token and 128-group (dynamic) and has no use for stored input scales"
        )
    block = qc.get("weight_block_size")
    if block is None:
        raise CheckpointError(
            f"{where}: no weight_block_size (per-tensor FP8) is not supported ({_SUPPORTED})"
        )
    if list(block) != list(BLOCK):
        raise CheckpointError(f"{where}: weight_block_size {list(block)} is not supported (only [128, 128])")
    scale_fmt = str(qc.get("scale_fmt", "float")).lower()
    if scale_fmt != "float":
        raise CheckpointError(f"{where}: scale_fmt {scale_fmt!r} is not supported (only float scales)")
    names = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    return Fp8Scheme(tuple(_canonical_module(str(n)) for n in names))


def resolve_quantization(
    requested: str | None, scheme: Fp8Scheme | None, checkpoint: Path | None
) -> str | None:
    """The engine's weight quantization: "fp8" or None (unquantised). requested: EngineConfig's
    (None = what the model declares, "none" = unquantised weights, "fp8"). A config declaring FP8
    gives FP8 (a checkpoint's e4m3 tensors loaded as they are; dummy weights quantised online); an
    FP8 checkpoint asked for as unquantised weights is a CheckpointError."""
    if requested == "none":
        if scheme is not None and checkpoint is not None:
            raise CheckpointError(
                f"{checkpoint} is an FP8 checkpoint (quantization_config fp8): it loads as FP8 weights "
                "only; drop --quantization none (or load the BF16 checkpoint)"
            )
        return None
    if scheme is not None:
        return "fp8"
    return requested
