"""Frozen configuration: the model's architecture facts and the engine's settings.

`ModelConfig` holds only what the checkpoint's config.json says; `EngineConfig` holds what the
user chose. Runtime facts (number of cache blocks, EOS ids from the tokenizer) live elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
CONFIG_DIR = PACKAGE_DIR / "configs"
FULL_CONFIG = CONFIG_DIR / "qwen3.6-35b-a3b.json"
DEFAULT_MODEL_DIR = PACKAGE_DIR / "assets" / "stdlib"  # trained by scripts/train_default_model.py

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    """Qwen3.5/3.6-MoE text model (`qwen3_5_moe_text`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_num_value_heads: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    # misc
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attn_output_gate: bool = True
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, expected {self.num_hidden_layers}"
            )
        bad = set(self.layer_types) - {LINEAR, FULL}
        if bad:
            raise ValueError(f"unknown layer types {sorted(bad)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError("num_experts_per_tok must be in [1, num_experts]")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} must be even and in (0, head_dim]")
        if not self.attn_output_gate:
            raise ValueError("only attn_output_gate=true models are supported")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (silu only)")
        for f in fields(self):
            v = getattr(self, f.name)
            if (
                isinstance(v, int)
                and not isinstance(v, bool)
                and f.name.endswith(("_size", "_heads", "_dim"))
            ):
                if v <= 0:
                    raise ValueError(f"{f.name} must be positive, got {v}")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Accepts a `qwen3_5_moe` config (nested `text_config`) or a `qwen3_5_moe_text` one."""
        model_type = raw.get("model_type")
        if "text_config" in raw:
            text = dict(raw["text_config"])
            if model_type not in (None, "qwen3_5_moe"):
                raise ValueError(f"unsupported model_type {model_type!r}")
        else:
            text = dict(raw)
        if text.get("model_type") not in (None, "qwen3_5_moe_text"):
            raise ValueError(f"unsupported text model_type {text.get('model_type')!r}")
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported")
        n_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        try:
            return cls(
                vocab_size=int(text["vocab_size"]),
                hidden_size=int(text["hidden_size"]),
                num_hidden_layers=n_layers,
                layer_types=tuple(layer_types),
                num_attention_heads=int(text["num_attention_heads"]),
                num_key_value_heads=int(text["num_key_value_heads"]),
                head_dim=int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]),
                rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
                partial_rotary_factor=float(
                    rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
                ),
                linear_num_key_heads=int(text["linear_num_key_heads"]),
                linear_key_head_dim=int(text["linear_key_head_dim"]),
                linear_num_value_heads=int(text["linear_num_value_heads"]),
                linear_value_head_dim=int(text["linear_value_head_dim"]),
                linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
                num_experts=int(text["num_experts"]),
                num_experts_per_tok=int(text["num_experts_per_tok"]),
                moe_intermediate_size=int(text["moe_intermediate_size"]),
                shared_expert_intermediate_size=int(text["shared_expert_intermediate_size"]),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
                tie_word_embeddings=bool(
                    text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
                ),
                mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0)),
                bos_token_id=text.get("bos_token_id"),
                eos_token_ids=eos_ids,
                attn_output_gate=bool(text.get("attn_output_gate", True)),
                hidden_act=str(text.get("hidden_act", "silu")),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks required field {e.args[0]!r}") from None

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Reads a model directory's config.json (or a config JSON file itself)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json at {p}")
        return cls.from_dict(json.loads(p.read_text()))

    def to_hf_text_dict(self) -> dict[str, Any]:
        """The equivalent `qwen3_5_moe_text` config.json (what transformers' reference is built from)."""
        d: dict[str, Any] = {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "hidden_act": self.hidden_act,
            "attn_output_gate": self.attn_output_gate,
        }
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = (
                list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
            )
        return d


DTYPES = ("bfloat16", "float16", "float32")
QUANTIZATIONS = (None, "fp8", "none")  # None: as the checkpoint declares; "none": unquantised weights
SPECULATIVE = (None, "ngram", "repeat", "mtp")  # repeat: the last token K times (judging the verify path)


DEFAULT_PREFILL_GRAPHS = (128, 256, 512, 1024, 2048)  # a prompt pads to the next size (<= 2x work)
SPEC_PREFILL_GRAPHS = (2, 4, 8, 16)  # with speculation (and 1 + K): a lone verify or recompute
SSM_STATE_DTYPES = ("float32", "bfloat16")  # the DeltaNet recurrent states' storage


@dataclass(frozen=True)
class EngineConfig:
    """What the user chose. `model` is a directory, `dummy:CONFIG_JSON`, or empty for the default."""

    model: str = ""
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    # weights: None = as config.json declares (an FP8 checkpoint loads as FP8), "fp8" (BF16 weights
    # quantised on load), "none" (unquantised; an error for an FP8 checkpoint)
    quantization: str | None = None
    # quantization "fp8": the untied lm_head in FP8 too (half its bytes per decode step; beyond the
    # published FP8 checkpoint, which keeps it BF16)
    fp8_lm_head: bool = False
    load_format: str = "auto"  # auto | safetensors | dummy
    seed: int = 0
    max_model_len: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096  # per-step token budget (chunked prefill)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from gpu_memory_utilization (CUDA) or a CPU default
    num_state_slots: int | None = None  # None: max_num_seqs
    gpu_memory_utilization: float = 0.90
    enforce_eager: bool = False  # CUDA graphs for decode (on CUDA, when the decode kernels exist)
    # step sizes of CUDA graphs for a prompt alone in a step (idle TTFT); None: the
    # DEFAULT_PREFILL_GRAPHS (with speculation also SPEC_PREFILL_GRAPHS) up to max_num_batched_tokens;
    # (): none
    prefill_graphs: tuple[int, ...] | None = None
    warmup: bool = True  # CUDA: eager steps of serving's shapes at start (JIT compiles out of the TTFT)
    async_scheduling: bool = True  # launch step N+1 before processing step N's tokens
    # speculative decoding: None, "ngram" (prompt-lookup drafts of greedy requests, verified in
    # one step; verifies and the probe steps before proposals run synchronously, the steps between
    # probes async: LLMEngine.SPEC_PROBE_MAX), or "repeat" (the last token drafted K times: every
    # eligible step verifies, so `verify` judges the verify path even where n-grams find nothing, as
    # on dummy weights), or "mtp" (the checkpoint's multi-token-prediction layer, chained: spec.mtp);
    # up to num_speculative_tokens drafts per sequence
    speculative: str | None = None
    num_speculative_tokens: int = 4
    # drafts only while at most this many sequences run and none waits: a verify alone in its step
    # replays a lone-prefill CUDA graph, a verify beside other sequences runs eager (slow on the GPU)
    speculative_max_seqs: int = 1
    # MTP drafts among the token ids below this only (0: the whole vocabulary): lm_head's first N rows
    # per draft instead of all 248,320 (spec.mtp.draft_head); outputs unchanged, acceptance lower where
    # the next token's id is >= N
    speculative_draft_vocab: int = 0
    # the DeltaNet recurrent states' storage (math stays fp32): "float32", or "bfloat16" (half the
    # state traffic of a decode step, ~1 GB per step at batch 32; vLLM's default for this model)
    ssm_state_dtype: str = "float32"
    # prefix caching: full KV blocks indexed by a hash chain of their tokens, and the DeltaNet states
    # snapshot at block-aligned chunk ends (engine.cache); a request starts after its longest cached
    # prefix that ends on a snapshot. Prompt chunks also stop at every multiple of
    # prefix_snapshot_interval tokens (None: max_num_batched_tokens, where a lone prompt's chunks end
    # anyway; rounded up to a multiple of block_size: `snapshot_interval`) and, for a prompt at least
    # that long, at its last block boundary, for a snapshot there. num_snapshot_slots: the snapshot
    # pool (one state slot each, beside the running ones); None: a share of the cache memory on CUDA
    # (runner.SNAPSHOT_SHARE, of free memory or beside num_kv_blocks' KV), a fixed count on the CPU
    enable_prefix_caching: bool = True
    prefix_snapshot_interval: int | None = None
    num_snapshot_slots: int | None = None
    tokenizer: str | None = None  # None: the model dir's tokenizer.json, else the Qwen3.6 tokenizer
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda; got {self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}; got {self.quantization!r}")
        if self.fp8_lm_head and self.quantization != "fp8":
            raise ValueError("fp8_lm_head needs quantization fp8 (the FP8 weight kernels)")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy; got {self.load_format!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        graph_sizes = [int(s) for s in self.prefill_graphs or ()]
        if any(s < 2 for s in graph_sizes):
            raise ValueError("prefill_graphs sizes must be >= 2 tokens")
        if any(s > self.max_num_batched_tokens for s in graph_sizes):
            raise ValueError(
                f"prefill_graphs sizes must be <= max_num_batched_tokens ({self.max_num_batched_tokens}): "
                "no step holds more tokens"
            )
        if any(s > self.max_model_len for s in graph_sizes):
            raise ValueError(
                f"prefill_graphs sizes must be <= max_model_len ({self.max_model_len}): the padding "
                "sequence lives in one block-table row"
            )
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {SPECULATIVE}; got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in 1..16; got {self.num_speculative_tokens}")
        if self.speculative_max_seqs < 1:
            raise ValueError(f"speculative_max_seqs must be >= 1; got {self.speculative_max_seqs}")
        if self.speculative_draft_vocab < 0:
            raise ValueError(f"speculative_draft_vocab must be >= 0; got {self.speculative_draft_vocab}")
        if self.ssm_state_dtype not in SSM_STATE_DTYPES:
            raise ValueError(
                f"ssm_state_dtype must be one of {SSM_STATE_DTYPES}; got {self.ssm_state_dtype!r}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive")
        if self.num_state_slots is not None and self.num_state_slots <= 0:
            raise ValueError("num_state_slots must be positive")
        if self.prefix_snapshot_interval is not None and self.prefix_snapshot_interval <= 0:
            raise ValueError(f"prefix_snapshot_interval must be > 0, got {self.prefix_snapshot_interval}")
        if self.num_snapshot_slots is not None and self.num_snapshot_slots < 0:
            raise ValueError("num_snapshot_slots must be >= 0")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError("gpu_memory_utilization must be in [0.05, 0.99]")

    @property
    def snapshot_interval(self) -> int:
        """prefix_snapshot_interval (or max_num_batched_tokens) rounded up to a multiple of block_size."""
        n = self.prefix_snapshot_interval or self.max_num_batched_tokens
        return -(-n // self.block_size) * self.block_size

    @property
    def prefill_graph_sizes(self) -> tuple[int, ...]:
        """The lone-prefill graph sizes in use (`prefill_graphs`, or its default clipped to the budget)."""
        if self.prefill_graphs is not None:
            return tuple(int(s) for s in self.prefill_graphs)
        bound = min(self.max_num_batched_tokens, self.max_model_len)
        small = sorted({*SPEC_PREFILL_GRAPHS, 1 + self.num_speculative_tokens}) if self.speculative else []
        return tuple(s for s in (*small, *DEFAULT_PREFILL_GRAPHS) if s <= bound)
