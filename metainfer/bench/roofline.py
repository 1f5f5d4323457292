"""Roofline model: bytes moved and FLOPs per decode step and per prefill, and the ceilings they imply.

Counted from a `ModelConfig` (one entry per stored tensor, see `weight_tensors`):
- weights: every non-expert tensor once per step; routed experts once per *distinct* expert a step
  touches per layer, E·(1-(1-k/E)^T) for T tokens routed uniformly (k at T=1, ~E for long prefills);
  one embedding row per token; lm_head once per step.
- FP8 (`dtype="fp8"`): the tensors an FP8 checkpoint quantises (DeltaNet in_proj_qkv/z and out_proj,
  attention q/k/v/o, shared and routed experts; lm_head only with `lm_head_dtype="fp8"`) take 1 B
  per weight plus one fp32 scale per 128x128 block; everything else stays BF16.
- DeltaNet recurrent state: fp32 [Hv, dk, dv] per layer per sequence, read and written each decode
  step (written once by a prefill); conv state [conv_dim, K-1] in BF16 likewise.
- KV cache (full-attention layers, BF16 by default): `context` tokens read plus one written per
  sequence at decode; the prompt's tokens written at prefill.
- Activations are not counted.
FLOPs: 2 per weight per token for matmuls (lm_head only for the last prompt token at prefill),
attention 4·Hq·hd per (query, key) pair (causal at prefill), DeltaNet ~7·Hv·dk·dv per token.
Time per step = max(bytes / bandwidth, FLOPs / peak).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from metainfer.config import DEFAULT_MODEL_DIR, FULL_CONFIG, ModelConfig

WEIGHT_BYTES = {"bfloat16": 2.0, "fp8": 1.0}
FP8_BLOCK = 128  # weight_block_size [128, 128]
SCALE_BYTES = 4  # fp32 weight_scale_inv per block
STATE_BYTES = 4  # fp32 DeltaNet recurrent state
CONV_STATE_BYTES = 2  # bf16 conv state
DEFAULT_BANDWIDTH_TB_S = 4.3  # measured H200: 4.25-4.32 TB/s
PEAK_TFLOPS = {"bfloat16": 790.0, "fp8": 1580.0}  # dense; measured BF16, FP8 assumed 2x
DELTANET_FLOPS_PER_STATE_ELEM = 7  # decay 1, k^T S 2, rank-1 update 2, q^T S 2

GROUPS = (
    "embedding",
    "deltanet",
    "attention",
    "router",
    "shared_expert",
    "routed_experts",
    "norms",
    "lm_head",
    "deltanet_state",
    "kv_cache",
)


@dataclass(frozen=True)
class Tensor:
    """One stored weight: `copies` tensors of [rows, cols] (cols 1 for vectors)."""

    name: str
    group: str
    rows: int
    cols: int
    copies: int
    quantizable: bool  # stored as e4m3 + block scales in an FP8 checkpoint

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.copies

    def nbytes(self, dtype: str) -> float:
        if dtype == "fp8" and self.quantizable:
            blocks = math.ceil(self.rows / FP8_BLOCK) * math.ceil(self.cols / FP8_BLOCK)
            return self.copies * (self.rows * self.cols * WEIGHT_BYTES["fp8"] + blocks * SCALE_BYTES)
        return self.params * WEIGHT_BYTES["bfloat16"]


def weight_tensors(cfg: ModelConfig) -> tuple[list[Tensor], list[Tensor]]:
    """(tensors read once per step, tensors of ONE routed expert in every layer)."""
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    nl, nf = len(cfg.linear_layer_ids), len(cfg.full_layer_ids)
    hd, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    I, Is = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    dense = [
        Tensor("deltanet.in_proj_qkv", "deltanet", cfg.linear_conv_dim, H, nl, True),
        Tensor("deltanet.in_proj_z", "deltanet", cfg.linear_value_dim, H, nl, True),
        Tensor("deltanet.in_proj_b", "deltanet", hv, H, nl, False),
        Tensor("deltanet.in_proj_a", "deltanet", hv, H, nl, False),
        Tensor("deltanet.conv1d", "deltanet", cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, nl, False),
        Tensor("deltanet.A_log+dt_bias", "deltanet", 2 * hv, 1, nl, False),
        Tensor("deltanet.norm", "deltanet", dv, 1, nl, False),
        Tensor("deltanet.out_proj", "deltanet", H, cfg.linear_value_dim, nl, True),
        Tensor("attention.q_proj (+gate)", "attention", 2 * hq * hd, H, nf, True),
        Tensor("attention.k_proj", "attention", hkv * hd, H, nf, True),
        Tensor("attention.v_proj", "attention", hkv * hd, H, nf, True),
        Tensor("attention.o_proj", "attention", H, hq * hd, nf, True),
        Tensor("attention.q_norm+k_norm", "attention", 2 * hd, 1, nf, False),
        Tensor("mlp.gate (router)", "router", cfg.num_experts, H, L, False),
        Tensor("shared_expert.gate_up_proj", "shared_expert", 2 * Is, H, L, True),
        Tensor("shared_expert.down_proj", "shared_expert", H, Is, L, True),
        Tensor("shared_expert_gate", "shared_expert", 1, H, L, False),
        Tensor("input+post_attention_layernorm", "norms", 2 * H, 1, L, False),
        Tensor("final norm", "norms", H, 1, 1, False),
        Tensor("lm_head", "lm_head", cfg.vocab_size, H, 1, True),
    ]
    expert = [
        Tensor("experts.gate_up_proj", "routed_experts", 2 * I, H, L, True),
        Tensor("experts.down_proj", "routed_experts", H, I, L, True),
    ]
    return dense, expert


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts hit by `tokens` tokens, each routed to top_k uniformly."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class StepCost:
    """Bytes and FLOPs of one engine step."""

    phase: str  # "decode" | "prefill"
    dtype: str
    lm_head_dtype: str
    kv_dtype: str
    concurrency: int  # sequences in the step (1 for prefill)
    context: int  # decode: cached tokens per sequence; prefill: prompt tokens
    tokens: int  # tokens produced (decode: concurrency) or processed (prefill: context)
    experts_per_layer: float
    bytes_by_group: tuple[tuple[str, float], ...]
    params_by_group: tuple[tuple[str, float], ...]  # weights read (params), per group
    flops: float

    @property
    def total_bytes(self) -> float:
        return sum(b for _, b in self.bytes_by_group)

    @property
    def weight_params(self) -> float:
        return sum(p for _, p in self.params_by_group)


@dataclass(frozen=True)
class Ceiling:
    """The fastest an engine can run a step on the given machine."""

    cost: StepCost
    bandwidth_tb_s: float
    peak_tflops: float
    memory_time_s: float
    compute_time_s: float
    step_time_s: float
    tok_s: float  # decode: tokens produced per s; prefill: prompt tokens per s
    bound: str  # "memory" | "compute"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cost"]["total_bytes"] = self.cost.total_bytes
        d["cost"]["weight_params"] = self.cost.weight_params
        return d


def _check_dtypes(dtype: str, lm_head_dtype: str, kv_dtype: str) -> None:
    for name, v in (("dtype", dtype), ("lm_head_dtype", lm_head_dtype), ("kv_dtype", kv_dtype)):
        if v not in WEIGHT_BYTES:
            raise ValueError(f"{name} must be bfloat16 or fp8, got {v!r}")


def _matmul_params(tensors: list[Tensor]) -> float:
    """Weights used in a multiply-add by every token (lm_head excluded: it runs on sampled positions)."""
    return float(sum(t.params for t in tensors if t.cols > 1 and t.group != "lm_head"))


def step_cost(
    cfg: ModelConfig,
    phase: str,
    dtype: str = "bfloat16",
    concurrency: int = 1,
    context: int = 0,
    lm_head_dtype: str | None = None,
    kv_dtype: str = "bfloat16",
    state_bytes: int = STATE_BYTES,
) -> StepCost:
    """A decode step of `concurrency` sequences at `context` cached tokens, or a `context`-token prefill.
    state_bytes: the DeltaNet recurrent states' element size (4: fp32, the default; 2: bf16 storage)."""
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase must be decode or prefill, got {phase!r}")
    lm_dt = lm_head_dtype or "bfloat16"
    _check_dtypes(dtype, lm_dt, kv_dtype)
    if concurrency < 1 or context < 0 or (phase == "prefill" and context < 1):
        raise ValueError("concurrency must be >= 1 and context >= 0 (>= 1 for prefill)")
    dense, expert = weight_tensors(cfg)
    nl, nf = len(cfg.linear_layer_ids), len(cfg.full_layer_ids)
    H = cfg.hidden_size
    seqs = concurrency if phase == "decode" else 1
    tokens = concurrency if phase == "decode" else context
    n_exp = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, tokens)

    by: dict[str, float] = dict.fromkeys(GROUPS, 0.0)
    params: dict[str, float] = dict.fromkeys(GROUPS, 0.0)
    for t in dense:
        by[t.group] += t.nbytes(lm_dt if t.group == "lm_head" else dtype)
        params[t.group] += t.params
    for t in expert:
        by[t.group] += n_exp * t.nbytes(dtype)
        params[t.group] += n_exp * t.params
    by["embedding"] = tokens * H * WEIGHT_BYTES["bfloat16"]
    params["embedding"] = tokens * H

    state = (
        nl * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * state_bytes
    )
    conv = nl * cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) * CONV_STATE_BYTES
    rw = 2 if phase == "decode" else 1  # decode reads and writes; prefill writes
    by["deltanet_state"] = seqs * rw * (state + conv)
    kv_per_token = nf * 2 * cfg.num_key_value_heads * cfg.head_dim * WEIGHT_BYTES[kv_dtype]
    by["kv_cache"] = seqs * (context + 1) * kv_per_token if phase == "decode" else context * kv_per_token

    lm_params = next(t.params for t in dense if t.group == "lm_head")
    per_token_params = _matmul_params(dense) + cfg.num_experts_per_tok * sum(t.params for t in expert)
    dn_flops = (
        nl
        * DELTANET_FLOPS_PER_STATE_ELEM
        * cfg.linear_num_value_heads
        * cfg.linear_key_head_dim
        * (cfg.linear_value_head_dim)
    )
    attn_pair = nf * 4 * cfg.num_attention_heads * cfg.head_dim  # FLOPs per (query, key) pair, all layers
    if phase == "decode":
        flops = concurrency * (2 * (per_token_params + lm_params) + dn_flops + attn_pair * (context + 1))
    else:
        pairs = context * (context + 1) / 2
        flops = 2 * context * per_token_params + 2 * lm_params + context * dn_flops + attn_pair * pairs
    return StepCost(
        phase=phase,
        dtype=dtype,
        lm_head_dtype=lm_dt,
        kv_dtype=kv_dtype,
        concurrency=seqs,
        context=context,
        tokens=tokens,
        experts_per_layer=n_exp,
        bytes_by_group=tuple((g, by[g]) for g in GROUPS),
        params_by_group=tuple((g, params[g]) for g in GROUPS if params[g]),
        flops=float(flops),
    )


def ceiling_of(
    cost: StepCost, bandwidth: float = DEFAULT_BANDWIDTH_TB_S, peak_tflops: float | None = None
) -> Ceiling:
    peak = peak_tflops or PEAK_TFLOPS[cost.dtype]
    mem = cost.total_bytes / (bandwidth * 1e12)
    comp = cost.flops / (peak * 1e12)
    step = max(mem, comp)
    return Ceiling(
        cost=cost,
        bandwidth_tb_s=bandwidth,
        peak_tflops=peak,
        memory_time_s=mem,
        compute_time_s=comp,
        step_time_s=step,
        tok_s=cost.tokens / step,
        bound="memory" if mem >= comp else "compute",
    )


def decode_ceiling(
    cfg: ModelConfig,
    dtype: str = "bfloat16",
    concurrency: int = 1,
    context: int = 0,
    bandwidth: float = DEFAULT_BANDWIDTH_TB_S,
    lm_head_dtype: str | None = None,
    kv_dtype: str = "bfloat16",
    peak_tflops: float | None = None,
    state_bytes: int = STATE_BYTES,
) -> Ceiling:
    """Decode tokens/s ceiling (all sequences together) at `concurrency` and `context` cached tokens."""
    cost = step_cost(cfg, "decode", dtype, concurrency, context, lm_head_dtype, kv_dtype, state_bytes)
    return ceiling_of(cost, bandwidth, peak_tflops)


def prefill_floor(
    cfg: ModelConfig,
    dtype: str = "bfloat16",
    prompt_len: int = 1024,
    bandwidth: float = DEFAULT_BANDWIDTH_TB_S,
    lm_head_dtype: str | None = None,
    kv_dtype: str = "bfloat16",
    peak_tflops: float | None = None,
) -> Ceiling:
    """The shortest prefill of one `prompt_len`-token prompt (its `step_time_s` is the TTFT floor)."""
    cost = step_cost(cfg, "prefill", dtype, 1, prompt_len, lm_head_dtype, kv_dtype)
    return ceiling_of(cost, bandwidth, peak_tflops)


def resolve_config_path(model: str | None, strict: bool = False) -> Path:
    """Config for a model argument: `dummy:PATH`, a directory or config file, '' (the default model).

    Anything else (a served model name) means the full Qwen3.6 config, unless `strict`.
    """
    if model is None:
        return FULL_CONFIG
    if model == "":
        default = DEFAULT_MODEL_DIR / "config.json"
        return default if default.is_file() else FULL_CONFIG
    path = Path(model[len("dummy:") :] if model.startswith("dummy:") else model)
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file():
        return path
    if strict:
        raise FileNotFoundError(f"no model config at {path}")
    return FULL_CONFIG


def format_ceiling(c: Ceiling, title: str) -> str:
    cost = c.cost
    lines = [f"{' ' + title + ' ':=^64}"]
    lines.append(
        f"weights {cost.dtype}, lm_head {cost.lm_head_dtype}, kv {cost.kv_dtype}; "
        f"{'concurrency ' + str(cost.concurrency) + ', context ' if cost.phase == 'decode' else 'prompt '}"
        f"{cost.context} tokens"
    )
    lines.append(f"bandwidth {c.bandwidth_tb_s:.2f} TB/s, peak {c.peak_tflops:.0f} TFLOP/s")
    lines.append(f"{'group':<20}{'weights read (M)':>20}{'bytes (MB)':>16}")
    params = dict(cost.params_by_group)
    for g, b in cost.bytes_by_group:
        if b == 0:
            continue
        p = params.get(g)
        lines.append(f"{g:<20}{(f'{p / 1e6:.1f}' if p else '-'):>20}{b / 1e6:>16.1f}")
    lines.append(f"{'total':<20}{cost.weight_params / 1e6:>20.1f}{cost.total_bytes / 1e6:>16.1f}")
    lines.append(f"routed experts read per layer: {cost.experts_per_layer:.1f}")
    per_token = cost.total_bytes / cost.tokens
    lines.append(f"bytes per step: {cost.total_bytes / 1e9:.3f} GB, per token {per_token / 1e6:.1f} MB")
    lines.append(f"FLOPs per step: {cost.flops / 1e9:.1f} GFLOP")
    lines.append(
        f"memory {c.memory_time_s * 1e3:.3f} ms, compute {c.compute_time_s * 1e3:.3f} ms -> {c.bound} bound"
    )
    if cost.phase == "decode":
        lines.append(f"ceiling: {c.tok_s:,.0f} tok/s ({c.tok_s / cost.concurrency:,.0f} tok/s per sequence)")
    else:
        lines.append(f"floor: {c.step_time_s * 1e3:.2f} ms ({c.tok_s:,.0f} prompt tok/s)")
    return "\n".join(lines)


def load_config(model: str | None, strict: bool = False) -> tuple[ModelConfig, Path]:
    path = resolve_config_path(model, strict)
    return ModelConfig.from_hf(path), path


# ---- what a ceiling assumes, in words (the labels of the roofline rows of `bench serve / offline`) ----
ASSUMED_GPU = "H200"  # the machine DEFAULT_BANDWIDTH_TB_S and PEAK_TFLOPS were measured on


def model_label(path: Path) -> str:
    """The model a config describes: the full Qwen3.6 config by name, a model dir by its folder."""
    path = Path(path)
    if path.resolve() == FULL_CONFIG.resolve():
        return "Qwen3.6-35B-A3B"
    return path.parent.name if path.name == "config.json" else path.stem


def gpu_label(bandwidth: float = DEFAULT_BANDWIDTH_TB_S) -> str:
    """The GPU a ceiling assumes: the H200 at its measured bandwidth, else the bandwidth given."""
    return ASSUMED_GPU if bandwidth == DEFAULT_BANDWIDTH_TB_S else f"a {bandwidth:g} TB/s GPU"


def assumption_label(
    path: Path, dtype: str, bandwidth: float = DEFAULT_BANDWIDTH_TB_S, lm_head_dtype: str | None = None
) -> str:
    """E.g. `H200 / Qwen3.6-35B-A3B FP8`: the GPU, model and precision a ceiling assumes."""
    names = {"bfloat16": "BF16", "fp8": "FP8"}
    prec = names.get(dtype, dtype)
    if lm_head_dtype and lm_head_dtype != "bfloat16":
        prec += f" (lm_head {names.get(lm_head_dtype, lm_head_dtype)})"
    return f"{gpu_label(bandwidth)} / {model_label(path)} {prec}"
