"""Prompt suites of the oracle: seeded random ids and real text, lengths from 1 token up.

A suite runs as one continuous batch: short prompts first, long ones split by chunked prefill
(`chunk_tokens` is the engine's per-step token budget), and a late wave that joins while the first
wave is already decoding. Two "twin" prompts share their second half and differ in the first, so
the reference shows whether the model's output depends on history (what cache bugs corrupt). The
full suite's first wave also carries 115 short random prompts, so decode steps of up to 129
sequences (the kernels of the throughput batches) are judged too, and its longest prompt has 32,000
tokens where the model allows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

SUITES = ("quick", "full")
ORDINARY_IDS = 248044  # Qwen3.6 ids below this are ordinary BPE tokens (no special tokens)
# the full suite's extra first-wave prompts (16-48 random ids each): with the others, decode steps of
# up to 129 sequences once the late wave joins (the grouped-MoE and FP8-GEMM decode kernels of the
# throughput batches, to concurrency 128)
WIDE_WAVE = 115
# capped to the model length; > 4096 tokens: judged on the decode rows only
FULL_LENGTHS = (1, 2, 17, 128, 1000, 4000, 8000, 32000)
QUICK_LENGTHS = (1, 2, 17, 64, 150)


class _Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Prompt:
    name: str
    token_ids: tuple[int, ...]
    source: str  # "random" | "text" | "random (text unavailable: ...)"

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Suite:
    """What one `verify` run feeds the engine. Indices refer to `prompts`."""

    name: str
    prompts: tuple[Prompt, ...]
    gen_tokens: int  # greedy continuation per prompt
    chunk_tokens: int  # engine step budget: prompts longer than this are prefilled in chunks
    late_from: int  # prompts[late_from:] arrive after `late_after_steps` engine steps
    late_after_steps: int
    alone: tuple[int, ...]  # also run alone: batch invariance
    twins: tuple[int, int]  # same second half, different first half
    sample_prompts: tuple[int, int]  # determinism: sampled at temperature 1
    sample_tokens: int
    seed: int

    @property
    def max_len(self) -> int:
        return max(len(p) for p in self.prompts) + self.gen_tokens

    def describe(self) -> dict:
        return {
            "name": self.name,
            "seed": self.seed,
            "prompts": [{"name": p.name, "len": len(p), "source": p.source} for p in self.prompts],
            "gen_tokens": self.gen_tokens,
            "chunk_tokens": self.chunk_tokens,
            "late_from": self.late_from,
            "late_after_steps": self.late_after_steps,
            "alone": [self.prompts[i].name for i in self.alone],
            "twins": [self.prompts[i].name for i in self.twins],
            "sample_prompts": [self.prompts[i].name for i in self.sample_prompts],
            "sample_tokens": self.sample_tokens,
        }


_SHORT = "The capital of France is"
_CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nExplain in two sentences why the sky is blue.<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n"
)
_CODE = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merges two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]


def test_merge_sorted():
    assert merge_sorted([1, 4, 9], [2, 3, 10]) =='''
_PROSE = (
    "The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only "
    "visitors were gulls and the supply boat that came on the first Monday of each month. The keeper, "
    "a patient man who had once been a schoolteacher, kept a log of every ship that passed, the state "
    "of the sea, and the colour of the sky at dawn. Over forty years the log filled eleven volumes.\n\n"
    "In the spring of the year the lamp failed, a storm came in from the west faster than any forecast "
    "had promised. The keeper climbed the tower with a paraffin lantern, a box of spare mantles and a "
    "coil of rope, and spent the night turning the lens by hand so that the beam would not stop.\n\n"
    "Engineers later estimated that the light had been dark for no more than four minutes in total. "
    "Three fishing boats and a small cargo steamer rounded the point that night; none of them knew how "
    "close they had come to the reef, and the keeper never told them.\n\n"
    "When the station was automated, the volumes of the log were sent to a maritime museum, where "
    "historians have used them to reconstruct the weather of the coast, the decline of the herring "
    "fleet, and the slow arrival of steam and then diesel. The last entry reads simply: light in good "
    "order, sea calm, wind light from the south-west, and the date.\n\n"
    "Questions for discussion: what does the log tell us that official records do not? Why might the "
    "keeper have chosen not to speak about the night of the storm? Write a short answer to each, "
    "using evidence from the passage, and then summarise the passage in one paragraph of your own."
)


def _random_ids(n: int, vocab: int, gen: torch.Generator) -> tuple[int, ...]:
    hi = min(vocab, ORDINARY_IDS)
    return tuple(torch.randint(0, hi, (n,), generator=gen).tolist())


def _text(
    name: str, text: str, vocab: int, tok: _Tokenizer | None, gen: torch.Generator, n_fallback: int
) -> Prompt:
    """Real text through the real tokenizer, or random ids of a similar length when the model's
    vocabulary cannot hold the tokenizer's ids."""
    if tok is not None and tok.vocab_size <= vocab:
        ids = tuple(tok.encode(text))
        if ids and max(ids) < vocab:
            return Prompt(name, ids, "text")
    why = "no tokenizer" if tok is None else f"tokenizer vocab {tok.vocab_size} > model vocab {vocab}"
    return Prompt(name, _random_ids(n_fallback, vocab, gen), f"random (text unavailable: {why})")


def _twins(n: int, vocab: int, gen: torch.Generator) -> tuple[Prompt, Prompt]:
    a = _random_ids(n, vocab, gen)
    head = _random_ids(n // 2, vocab, gen)
    b = head + a[n // 2 :]
    return Prompt(f"twin-a-{n}", a, "random"), Prompt(f"twin-b-{n}", b, "random (twin-a, new first half)")


def build_suite(
    name: str,
    vocab_size: int,
    tokenizer: _Tokenizer | None = None,
    seed: int = 0,
    max_model_len: int | None = None,
) -> Suite:
    """The named suite for a model with `vocab_size` ids; random lengths are capped so that every
    prompt plus its continuation fits `max_model_len`."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose one of {', '.join(SUITES)}")
    gen = torch.Generator().manual_seed(seed)
    full = name == "full"
    gen_tokens = 48 if full else 12
    cap = (max_model_len - gen_tokens - 1) if max_model_len else None
    lengths: Sequence[int] = FULL_LENGTHS if full else QUICK_LENGTHS
    if cap is not None:
        lengths = sorted({max(1, min(n, cap)) for n in lengths})
    prompts = [Prompt(f"rand-{n}", _random_ids(n, vocab_size, gen), "random") for n in lengths]
    if full:  # a wide first wave: decode steps of ~60-70 sequences (the throughput batches' kernels)
        wide_lens = torch.randint(16, 49, (WIDE_WAVE,), generator=gen).tolist()
        prompts += [Prompt(f"wide-{i:02d}", _random_ids(min(n, cap or n), vocab_size, gen), "random")
                    for i, n in enumerate(wide_lens)]
    tw = min(512 if full else 48, cap or 512)
    twin_a, twin_b = _twins(tw, vocab_size, gen)
    specs = [("text-short", _SHORT, 5), ("text-chat", _CHAT, 40)]
    if full:
        specs += [("text-code", _CODE, 150), ("text-long", _PROSE, 450)]
    texts = [_text(n, t, vocab_size, tokenizer, gen, k) for n, t, k in specs]
    if cap is not None:
        texts = [Prompt(t.name, t.token_ids[:cap], t.source) for t in texts]
    prompts = prompts + [twin_a] + texts + [twin_b]
    late_from = len(lengths) + (WIDE_WAVE if full else 0) + 1
    names = [p.name for p in prompts]
    alone_names = ("rand-17", "rand-1000") if full else ("rand-17", "rand-150")
    alone = tuple(names.index(n) for n in alone_names if n in names) or (0,)
    return Suite(
        name=name,
        prompts=tuple(prompts),
        gen_tokens=gen_tokens,
        chunk_tokens=1024 if full else 64,
        late_from=late_from,
        late_after_steps=4 if full else 2,
        alone=alone,
        twins=(names.index(twin_a.name), names.index(twin_b.name)),
        sample_prompts=(min(2, len(lengths) - 1), late_from),
        sample_tokens=32 if full else 24,
        seed=seed,
    )
