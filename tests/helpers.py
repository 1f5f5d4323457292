"""Shared test fixtures: tiny configs and HF reference models built on the engine's dummy weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def write_config(d: Path, **overrides) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    cfg = {**TINY, **overrides}
    (d / "config.json").write_text(json.dumps(cfg))
    return d / "config.json"


def save_hf_model(d: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """A transformers Qwen3_5MoeForCausalLM carrying the engine's dummy weights, saved with
    save_pretrained to `d` (the key layout transformers writes). Returns the HF model (fp32)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from metainfer.config import ModelConfig
    from metainfer.model.weights import build_model, hf_state_dict, init_dummy

    cfg_path = write_config(d, **overrides)
    mc = ModelConfig.from_hf(cfg_path)
    eng = build_model(mc, torch.float32, "cpu")
    init_dummy(eng, seed)
    sd = {k: v.clone() for k, v in hf_state_dict(eng).items()}
    hf_cfg = Qwen3_5MoeTextConfig(
        **{k: v for k, v in json.loads(cfg_path.read_text()).items() if k != "architectures"}
    )
    hf = Qwen3_5MoeForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert not [m for m in missing if "rotary" not in m], missing
    hf.save_pretrained(d)
    return hf


def rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def token_prompts(lengths, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """Random token-id prompts of the given lengths (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def teacher_forced_greedy(hf, prompt: list[int], continuation: list[int]) -> list[int]:
    """transformers' greedy next token after `prompt` + each prefix of `continuation`, from one forward
    pass over prompt + continuation[:-1]. It equals `continuation` exactly when transformers' own
    greedy decoding of `prompt` would generate `continuation` (step by step, each prefix is the same),
    without one forward per generated token."""
    ids = list(prompt) + list(continuation[:-1])
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), use_cache=False).logits[0]
    return logits[len(prompt) - 1 :].argmax(-1).tolist()
