"""Trains MetaInfer's embedded default model, `metainfer/assets/stdlib`, on the Python standard library.

Seeded, CPU-only, about 30 minutes on one thread (two threads on shared cores mostly wait on each other).
A byte-level BPE tokenizer and a small `qwen3_5_moe_text` model (transformers' `Qwen3_5MoeForCausalLM`)
are trained on the `.py` files of the running Python's standard library, then an MTP layer (the engine's
math and weight names, built from transformers' modules) on top of the frozen model. Held-out loss, MTP
acceptance (measured with the engine's own model and `MTP` module) and greedy samples are printed and
written to README.md beside config.json, model-0000N-of-0000M.safetensors + index (bf16, shards under
4 MiB), tokenizer.json, generation_config.json.

    nice -n 10 python scripts/train_default_model.py [--out DIR] [--steps N] [--mtp-steps N]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_OUT = REPO / "metainfer" / "assets" / "stdlib"

VOCAB = 4096
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # after the BPE tokens, as in Qwen
THINK = ("<think>", "</think>")  # the last two ids; plain (not special) tokens, as in Qwen
ENDOFTEXT, IM_END = VOCAB - 5, VOCAB - 3
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data"}
VAL_EVERY = 20  # one file in 20, chosen by the SHA-256 of its relative path, is held out
SEQ, BATCH = 512, 4
PEAK_LR, WARMUP = 3e-3, 50

CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "attn_output_gate": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "mtp_num_hidden_layers": 1,
    "hidden_act": "silu",
    "router_aux_loss_coef": 0.001,
    "bos_token_id": ENDOFTEXT,
    "eos_token_id": [IM_END, ENDOFTEXT],
}


# ---- data ------------------------------------------------------------------------------------------
def corpus_split() -> tuple[list[Path], list[Path], Path]:
    """(train files, validation files, stdlib root): the stdlib's .py files in sorted order, without
    test directories, site-packages and generated data (pydoc topics, gencodec tables); held out by
    path hash."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in sorted(root.rglob("*.py"))
        if not EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1]) and "gencodec.py" not in read(p)[:2000]
    ]

    def held_out(p: Path) -> bool:
        return int(hashlib.sha256(p.relative_to(root).as_posix().encode()).hexdigest(), 16) % VAL_EVERY == 0

    return [p for p in files if not held_out(p)], [p for p in files if held_out(p)], root


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str]):
    """Byte-level BPE of VOCAB tokens: the 256 bytes and the merges, then SPECIAL, then the think tags."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(SPECIAL) - len(THINK),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id(SPECIAL[0]) == ENDOFTEXT
    assert tok.token_to_id(SPECIAL[2]) == IM_END and tok.token_to_id(THINK[1]) == VOCAB - 1
    return tok


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    """All texts as one int64 stream [N], each preceded by <|endoftext|>."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += [ENDOFTEXT, *enc.ids]
    return torch.tensor(ids, dtype=torch.int64)


def sample_batch(stream: torch.Tensor, gen: torch.Generator, length: int) -> torch.Tensor:
    """BATCH windows [BATCH, length] at seeded random offsets."""
    starts = torch.randint(0, len(stream) - length, (BATCH,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def heldout_snippets(val_texts: list[str], n: int = 8) -> list[str]:
    """From each of the first n held-out files with a `def` line: that line and the next ones, whole
    lines up to at least 80 characters."""
    out = []
    for text in val_texts:
        lines = text.splitlines(keepends=True)
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("def ")), None)
        if start is not None and len(out) < n:
            ends = [j for j in range(start + 1, len(lines) + 1) if len("".join(lines[start:j])) >= 80]
            out.append("".join(lines[start : ends[0] if ends else len(lines)]))
    return out


# ---- training --------------------------------------------------------------------------------------
def lr_at(step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    frac = (step - WARMUP) / max(1, total - WARMUP)
    return PEAK_LR * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and expert tensors only."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=PEAK_LR, betas=(0.9, 0.95))


def run_steps(module: nn.Module, steps: int, loss_fn, label: str) -> None:
    """`steps` AdamW steps of `loss_fn(step)` on `module`'s trainable parameters, logged every 25."""
    opt = optimizer(module)
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps)
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            lr, minutes = opt.param_groups[0]["lr"], (time.time() - t0) / 60
            print(f"[{label}] step {step:4d}/{steps} loss {loss.item():.4f} lr {lr:.2e} {minutes:.1f} min")


@torch.no_grad()
def evaluate(model, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) over windows [N, L] (each window's L-1 predictions)."""
    model.eval()
    losses = [model(input_ids=w, labels=w, use_cache=False).loss.item() for w in windows.split(BATCH)]
    sizes = [len(w) for w in windows.split(BATCH)]
    return sum(x * n for x, n in zip(losses, sizes)) / sum(sizes)


class MTPLayer(nn.Module):
    """The engine's MTP head (`metainfer.model.qwen3_5_moe.MTP`) in transformers' modules, with the same
    names (`mtp.` + state_dict key): fc(cat(pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)))
    -> one full-attention MoE decoder layer -> norm; the shared lm_head gives token t+2. Starts as a copy
    of the model's last full-attention layer and final norm, with fc summing both inputs."""

    def __init__(self, model) -> None:
        super().__init__()
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

        cfg = model.config
        H = cfg.hidden_size
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(H, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(H, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.cat([torch.eye(H), torch.eye(H)], dim=1))
        last_full = max(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
        self.layers = nn.ModuleList([copy.deepcopy(model.model.layers[last_full])])
        self.norm = copy.deepcopy(model.model.norm)
        self.requires_grad_(True)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.layers[0](x, position_embeddings=position_embeddings))


def mtp_loss(model, mtp: MTPLayer, w: torch.Tensor) -> torch.Tensor:
    """Distillation loss on windows w [B, L+1]: MTP row t (h_t, token t+1, position t) against the
    frozen model's next-token distribution at t+1 (its prediction of token t+2)."""
    with torch.no_grad():
        hidden = model.model(input_ids=w, use_cache=False).last_hidden_state  # [B, L+1, H] final-normed
        target = F.softmax(model.lm_head(hidden[:, 1:]), dim=-1)  # [B, L, V]
        embeds = model.model.embed_tokens(w[:, 1:])
        pos = torch.arange(w.shape[1] - 1).expand(w.shape[0], -1)
        pe = model.model.rotary_emb(hidden, pos)
    logits = model.lm_head(mtp(embeds, hidden[:, :-1], pe))
    return -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()


# ---- writing ---------------------------------------------------------------------------------------
def save_sharded(tensors: dict[str, torch.Tensor], out: Path, max_bytes: int = 4 << 20) -> None:
    """HF sharded safetensors: model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(tensors):
        n = tensors[k].numel() * tensors[k].element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = tensors[k]
        size += n
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def save(model, mtp: MTPLayer, tok, out: Path) -> None:
    """config.json, generation_config.json, tokenizer.json and the weights (bf16, transformers' key
    names plus `mtp.*`, sharded so that no file exceeds 4 MiB)."""
    out.mkdir(parents=True, exist_ok=True)
    sd = dict(model.state_dict())
    sd.update({f"mtp.{k}": v for k, v in mtp.state_dict().items()})
    save_sharded({k: sd[k].detach().to(torch.bfloat16).contiguous() for k in sorted(sd)}, out)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    gen = {"bos_token_id": CONFIG["bos_token_id"], "eos_token_id": CONFIG["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"), pretty=False)


# ---- measuring with the engine ---------------------------------------------------------------------
def engine_model(model_dir: Path):
    """The engine's Qwen3_5MoeModel (float32, CPU) with the checkpoint's weights, MTP included."""
    from metainfer.config import ModelConfig
    from metainfer.model.weights import build_model, load_checkpoint

    m = build_model(ModelConfig.from_hf(model_dir), torch.float32, "cpu")
    load_checkpoint(m, model_dir, progress=False)
    return m


@torch.inference_mode()
def engine_logits_with_mtp(m, ids: list[int], block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(main logits [L, V], MTP logits [L-1, V]) of one sequence through the engine's model and its
    `MTP` module, prefilled with fresh caches. MTP row t sees h_t and token t+1 at position t."""
    from metainfer.forward_meta import CacheTensors, ForwardMeta

    c, L = m.cfg, len(ids)
    nb = -(-L // block_size)
    kv = (nb + 1, block_size, c.num_key_value_heads, c.head_dim)
    n_full, n_lin = len(c.full_layer_ids), len(c.linear_layer_ids)
    caches = CacheTensors(
        k=[torch.zeros(kv) for _ in range(n_full + 1)],  # the last one is the MTP layer's
        v=[torch.zeros(kv) for _ in range(n_full + 1)],
        conv=[torch.zeros(2, c.linear_conv_kernel_dim - 1, c.linear_conv_dim) for _ in range(n_lin)],
        ssm=[
            torch.zeros(2, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
            for _ in range(n_lin)
        ],
    )

    def meta(n: int) -> ForwardMeta:
        return ForwardMeta.build([n], [0], [list(range(1, nb + 1))], [1], block_size, list(range(n)), "cpu")

    x, pos = torch.tensor(ids), torch.arange(L)
    h = m(x, pos, meta(L), caches)  # [L, H] final-normed
    hm = m.mtp(m.embed_tokens(x[1:]), h[:-1], pos[:-1], meta(L - 1), caches)
    return m.compute_logits(h), m.compute_logits(hm)


def mtp_acceptance(m, seqs: list[list[int]], starts: list[int]) -> tuple[int, int]:
    """(hits, positions): rows t with t + 2 >= start where argmax MTP(t) equals the main model's greedy
    token at t+2 (argmax of its logits at t+1)."""
    hits = total = 0
    for ids, s in zip(seqs, starts):
        main, mtp = engine_logits_with_mtp(m, ids)
        ok = mtp.argmax(-1) == main[1:].argmax(-1)  # [L-1]
        ok = ok[max(s - 2, 0) :]
        hits, total = hits + int(ok.sum()), total + len(ok)
    return hits, total


def engine_greedy(model_dir: Path, prompts: list[list[int]], n: int, ignore_eos: bool = True) -> list:
    """Greedy continuations of up to n tokens through the engine (`LLM`, float32, CPU)."""
    from metainfer.llm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [o.token_ids for o in outs]


# ---- main ------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=1300, help="main-model steps of BATCH x SEQ tokens")
    ap.add_argument("--mtp-steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="1: deterministic, and fastest on shared cores")
    args = ap.parse_args()
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    sys.stdout.reconfigure(line_buffering=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    train_files, val_files, root = corpus_split()
    train_texts, val_texts = [read(p) for p in train_files], [read(p) for p in val_files]
    tok = train_tokenizer(train_texts)
    train, val = token_stream(tok, train_texts), token_stream(tok, val_texts)
    val_windows = val[: len(val) // SEQ * SEQ].view(-1, SEQ)
    print(
        f"Python {platform.python_version()} stdlib {root}: {len(train_files)} train files "
        f"({len(train)} tokens), {len(val_files)} held-out files ({len(val)} tokens)"
    )

    hf_cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"})
    model = Qwen3_5MoeForCausalLM(hf_cfg)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    gen = torch.Generator().manual_seed(args.seed)

    def main_loss(step: int) -> torch.Tensor:
        model.train()
        w = sample_batch(train, gen, SEQ)
        loss = model(input_ids=w, labels=w, output_router_logits=True, use_cache=False).loss
        if step % 200 == 199:
            print(f"  held-out loss (first 32 windows) {evaluate(model, val_windows[:32]):.4f}")
        return loss

    run_steps(model, args.steps, main_loss, "model")
    model.eval().requires_grad_(False)
    mtp = MTPLayer(model)
    run_steps(mtp, args.mtp_steps, lambda _: mtp_loss(model, mtp, sample_batch(train, gen, SEQ + 1)), "mtp")
    save(model, mtp, tok, args.out)
    train_min = (time.time() - t_start) / 60

    saved = Qwen3_5MoeForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    val_loss = evaluate(saved, val_windows)
    val_bytes = len("".join(val_texts).encode())
    snippets = heldout_snippets(val_texts)
    prompts = [tok.encode(s).ids for s in snippets]
    conts = engine_greedy(args.out, prompts, 64)
    eng = engine_model(args.out)
    g_hits, g_total = mtp_acceptance(eng, [p + c for p, c in zip(prompts, conts)], [len(p) for p in prompts])
    texts = [w.tolist() for w in val_windows[:16]]
    t_hits, t_total = mtp_acceptance(eng, texts, [0] * len(texts))
    fib = engine_greedy(args.out, [tok.encode("def fibonacci(n):").ids], 64, ignore_eos=False)[0]
    figures = {
        "python": platform.python_version(),
        "train_tokens": len(train),
        "tokens_seen": args.steps * BATCH * SEQ,
        "heldout_tokens": len(val_windows) * SEQ,
        "heldout_loss": round(val_loss, 4),
        "heldout_perplexity": round(math.exp(val_loss), 2),
        "heldout_bits_per_byte": round(val_loss / math.log(2) * len(val) / val_bytes, 3),
        "uniform_perplexity": VOCAB,
        "mtp_acceptance_greedy": round(g_hits / g_total, 4),
        "mtp_acceptance_text": round(t_hits / t_total, 4),
        "mtp_positions": [g_total, t_total],
        "train_minutes": round(train_min, 1),
        "total_minutes": round((time.time() - t_start) / 60, 1),
    }
    print(json.dumps(figures, indent=2))
    for s, c in zip(snippets, conts):
        print(f"--- {s!r}\n{s}\033[1m{tok.decode(c)}\033[0m")
    print(f"--- def fibonacci(n):\ndef fibonacci(n):{tok.decode(fib)}")
    write_readme(args.out, figures, "def fibonacci(n):" + tok.decode(fib))
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({size} bytes)")
    return 0


def write_readme(out: Path, f: dict, sample: str) -> None:
    """README.md with the figures of this run."""
    c = CONFIG
    f = dict(f, bpb=f["heldout_bits_per_byte"])
    text = f"""# stdlib: MetaInfer's embedded default model

Every feature of Qwen3.6-35B-A3B at toy size: {c["num_hidden_layers"]} layers (3 Gated DeltaNet + 1 gated
attention, twice), hidden {c["hidden_size"]}, MoE {c["num_experts"]} experts top-{c["num_experts_per_tok"]} +
shared expert, 1 MTP layer, untied lm_head; bf16 weights. Byte-level BPE of {VOCAB} tokens; specials after
it as in Qwen: `<|endoftext|>` {ENDOFTEXT}, `<|im_start|>` {ENDOFTEXT + 1}, `<|im_end|>` {IM_END}, `<think>`
{VOCAB - 2}, `</think>` {VOCAB - 1}. Made by `nice -n 10 python scripts/train_default_model.py` (seeded,
CPU-only, {f["total_minutes"]} min) from the `.py` files of the Python {f["python"]} standard library
(no tests, site-packages or generated tables; one file in {VAL_EVERY} held out by path hash):
{f["tokens_seen"]} tokens seen of {f["train_tokens"]}.

| held-out figure | value |
|---|---|
| loss, {f["heldout_tokens"]} tokens | {f["heldout_loss"]} nats/token, {f["bpb"]} bits/byte |
| perplexity | {f["heldout_perplexity"]} (uniform: {f["uniform_perplexity"]}) |
| MTP acceptance, greedy continuations | {f["mtp_acceptance_greedy"]} ({f["mtp_positions"][0]} positions) |
| MTP acceptance, held-out text | {f["mtp_acceptance_text"]} ({f["mtp_positions"][1]} positions) |

MTP acceptance: how often the argmax of the MTP head (hidden state at t, embedding of token t+1,
position t) is the main model's greedy token at t+2, with the engine's model and `MTP` module, along
64-token greedy continuations of 8 held-out snippets and along 16 held-out {SEQ}-token windows.

`metainfer generate --model metainfer/assets/stdlib "def fibonacci(n):"` (greedy, 64 tokens):

```python
{sample}
```
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
