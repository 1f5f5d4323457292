"""The embedded trained model, metainfer/assets/stdlib (written by scripts/train_default_model.py).

The engine (float32, CPU) and transformers' Qwen3_5MoeForCausalLM (float32) load the same bfloat16
checkpoint and must agree: teacher-forced logits, and greedy continuations of 64 tokens on 8 held-out
snippets. The MTP head (ignored by transformers) is checked against the training script's
transformers-module version of it, and for a useful acceptance rate.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from metainfer.config import FULL, LINEAR, PACKAGE_DIR, ModelConfig
from metainfer.llm import LLM, SamplingParams
from tests.helpers import rel_rmse, teacher_forced_greedy

pytest.importorskip("transformers")

MODEL_DIR = PACKAGE_DIR / "assets" / "stdlib"
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_default_model.py"
MAX_BYTES = 8_000_000
N_TOKENS = 64

# The script's held-out snippets (files of the Python 3.11 stdlib outside its training split).
SNIPPETS = [
    "    def __init__(self, name, eof):\n        self.name = name\n        self.eof = eof\n",
    "    def __init__(self, callback, args, loop, context=None):\n        if context is None:\n",
    "    def __init__(self, file, align=True, bigendian=True, inclheader=False):\n        import struct\n",
    "    def __new__(cls, encode, decode, streamreader=None, streamwriter=None,\n"
    "        incrementalencoder=None, incrementaldecoder=None, name=None,\n",
    'def open(file, flag=\'r\', mode=0o666):\n    """Open or create database at path given by *file*.\n',
    "    def initialize_options(self):\n        self.build_dir = None\n        self.scripts = None\n",
    "    def initialize_options(self):\n"
    "        # let the 'install' command dictate our installation directory\n",
    "def newer (source, target):\n"
    '    """Return true if \'source\' exists and is more recently modified than\n',
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(MODEL_DIR), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf():
    from transformers import Qwen3_5MoeForCausalLM

    return Qwen3_5MoeForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def greedy(llm) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [llm.tokenizer.encode(s) for s in SNIPPETS]
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
    return prompts, [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def test_layout_and_config():
    from safetensors import safe_open

    from metainfer.model.weights import build_model, param_targets

    sizes = {p.name: p.stat().st_size for p in MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "generation_config.json"} <= set(
        sizes
    )
    assert sum(sizes.values()) <= MAX_BYTES, sizes
    assert max(sizes.values()) <= 5 << 20, "no committed file over 5 MB"
    cfg = ModelConfig.from_hf(MODEL_DIR)
    assert set(cfg.layer_types) == {LINEAR, FULL} and cfg.mtp_num_hidden_layers == 1
    assert cfg.attn_output_gate and not cfg.tie_word_embeddings
    assert cfg.num_experts > cfg.num_experts_per_tok and cfg.shared_expert_intermediate_size > 0
    keys = set()
    for shard in sorted(MODEL_DIR.glob("model-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            keys |= set(f.keys())
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    expected = set(param_targets(build_model(cfg, torch.float32, "meta")))
    assert keys == expected, (sorted(keys - expected)[:5], sorted(expected - keys)[:5])
    assert {"lm_head.weight", "model.embed_tokens.weight", "mtp.fc.weight", "mtp.norm.weight"} <= keys


def test_tokenizer(llm):
    tok, cfg = llm.tokenizer, llm.engine.model_config
    assert tok.vocab_size == cfg.vocab_size
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert tok.encode(t) == [tok.token_to_id(t)], t
    assert {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")} <= set(llm.engine.eos_token_ids)
    for s in SNIPPETS:
        assert tok.decode(tok.encode(s)) == s


def test_greedy_engine_equals_transformers(hf, greedy):
    """transformers' greedy decoding of every snippet gives the engine's 64 tokens (checked along the
    engine's continuation: `teacher_forced_greedy`)."""
    prompts, outs = greedy
    for p, got in zip(prompts, outs):
        assert len(got) == N_TOKENS
        assert teacher_forced_greedy(hf, p, got) == got, len(p)


def test_logits_and_perplexity(llm, hf, greedy):
    prompts, outs = greedy
    seqs = [p + o for p, o in zip(prompts, outs)]
    nll, n = 0.0, 0
    for p, got in zip(prompts, llm.score(prompts)):
        with torch.no_grad():
            ref = hf(torch.tensor([p]), use_cache=False).logits[0]
        assert rel_rmse(got, ref) <= 1e-4
        nll += float(torch.nn.functional.cross_entropy(got[:-1], torch.tensor(p[1:]), reduction="sum"))
        n += len(p) - 1
    assert math.exp(nll / n) < llm.engine.model_config.vocab_size / 40  # uniform: vocab_size
    for got, s in zip(llm.score(seqs[:2]), seqs[:2]):
        with torch.no_grad():
            assert rel_rmse(got, hf(torch.tensor([s]), use_cache=False).logits[0]) <= 1e-4


def test_mtp_head(hf, greedy, script):
    from safetensors.torch import load_file

    mtp = script.MTPLayer(hf)
    sd = {
        k: v
        for shard in sorted(MODEL_DIR.glob("model-*.safetensors"))
        for k, v in load_file(str(shard)).items()
    }
    mtp.load_state_dict({k[len("mtp.") :]: v.float() for k, v in sd.items() if k.startswith("mtp.")})
    eng = script.engine_model(MODEL_DIR)
    prompts, outs = greedy
    ids = prompts[0] + outs[0]
    main, got = script.engine_logits_with_mtp(eng, ids)
    x = torch.tensor([ids])
    with torch.no_grad():
        hidden = hf.model(input_ids=x, use_cache=False).last_hidden_state
        pe = hf.model.rotary_emb(hidden, torch.arange(len(ids) - 1)[None])
        ref = hf.lm_head(mtp(hf.model.embed_tokens(x[:, 1:]), hidden[:, :-1], pe))[0]
    assert rel_rmse(got, ref) <= 1e-4
    seqs = [p + o for p, o in zip(prompts, outs)]
    hits, total = script.mtp_acceptance(eng, seqs, [len(p) for p in prompts])
    assert hits / total >= 0.4, (hits, total)
