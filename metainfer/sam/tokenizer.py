"""Prompt tokenizer: CLIP's byte-level BPE (lower-cased, `</w>` word ends) through the `tokenizers`
library, from a checkpoint's tokenizer.json or its vocab.json + merges.txt.

encode(prompts) -> ids [P, T], valid [P, T] with T = the text context: BOS, the prompt's tokens (cut to
fit), EOS, then EOS padding marked invalid — as transformers' Sam3Processor pads (max_length 32).
"""

from __future__ import annotations

from pathlib import Path

import torch

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
# CLIP's pre-tokenisation: contractions, letter runs, single digits, other non-space runs
CLIP_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def clip_pipeline(model):  # model: tokenizers.models.BPE
    """A `tokenizers.Tokenizer` with CLIP's normaliser and pre-tokeniser around `model`."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers

    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(CLIP_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


class PromptTokenizer:
    def __init__(self, tok, context: int) -> None:
        self.tok = tok
        self.context = context
        self.bos = tok.token_to_id(BOS)
        self.eos = tok.token_to_id(EOS)
        if self.bos is None or self.eos is None:
            raise ValueError(f"tokenizer lacks {BOS} or {EOS}")

    @classmethod
    def from_dir(cls, path: str | Path, context: int) -> PromptTokenizer:
        from tokenizers import Tokenizer, models

        d = Path(path)
        if (d / "tokenizer.json").is_file():
            return cls(Tokenizer.from_file(str(d / "tokenizer.json")), context)
        vocab, merges = d / "vocab.json", d / "merges.txt"
        if vocab.is_file() and merges.is_file():
            bpe = models.BPE.from_file(str(vocab), str(merges), end_of_word_suffix="</w>", unk_token=EOS)
            return cls(clip_pipeline(bpe), context)
        raise FileNotFoundError(f"{d}: no tokenizer.json, nor vocab.json + merges.txt")

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((len(prompts), self.context), self.eos, dtype=torch.long)
        valid = torch.zeros(len(prompts), self.context, dtype=torch.bool)
        for i, text in enumerate(prompts):
            if not text.strip():
                raise ValueError("empty prompt")
            body = self.tok.encode(text, add_special_tokens=False).ids[: self.context - 2]
            row = [self.bos, *body, self.eos]
            ids[i, : len(row)] = torch.tensor(row)
            valid[i, : len(row)] = True
        return ids, valid


def train_tokenizer(texts: list[str], vocab_size: int):
    """A CLIP-style BPE (`tokenizers.Tokenizer`) trained on `texts`: byte alphabet, `</w>` word ends,
    BOS/EOS as ids 0 and 1."""
    from tokenizers import models, pre_tokenizers, trainers

    tok = clip_pipeline(models.BPE(end_of_word_suffix="</w>", unk_token=EOS))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    # every printable ASCII character as a word of its own, so each has its word-final token
    ascii_words = " ".join(chr(c) for c in range(33, 127))
    tok.train_from_iterator([*texts, ascii_words], trainer)
    return tok
