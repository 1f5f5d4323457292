"""Prompt sets for the benchmarks.

- `random`: prompts of exactly N tokens (token ids drawn uniformly from the tokenizer's ordinary,
  non-special range, optionally capped by the model's vocab), sent as token ids; seeded.
- `structured`: repetitive, high-overlap text (JSON records, CSV rows, small code edits), the case
  where n-gram/MTP speculation pays; deterministic by seed; trimmed/padded to N tokens, sent as ids.
- `file:PATH`: JSONL, one `{"prompt": str}` or `{"prompt_token_ids": [int]}` per line, with an
  optional `"output_len"` (default: the requested output length).

With a range ratio R > 0, random and structured prompts draw input and output lengths uniformly
in [N(1-R), N(1+R)] (at least 1 token).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from metainfer.tokenizer import Tokenizer


@dataclass(frozen=True)
class SampleRequest:
    prompt_len: int  # tokens, by our tokenizer (for text prompts, the server may count differently)
    output_len: int  # max_tokens to ask for
    prompt_token_ids: tuple[int, ...] | None = None  # sent as a token-id prompt when set
    prompt: str | None = None  # sent as text when there are no ids

    def __post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            raise ValueError("exactly one of prompt_token_ids and prompt must be set")
        if self.output_len < 1:
            raise ValueError("output_len must be at least 1")

    @property
    def payload_prompt(self) -> str | list[int]:
        return list(self.prompt_token_ids) if self.prompt_token_ids is not None else str(self.prompt)


@dataclass(frozen=True)
class DatasetSpec:
    name: str  # "random" | "structured" | "file"
    input_len: int
    output_len: int
    num_prompts: int
    range_ratio: float = 0.0
    seed: int = 0
    path: str | None = None  # for "file"
    vocab_limit: int | None = None  # random ids are < this (e.g. a small model's vocab)

    def __post_init__(self) -> None:
        if self.name not in ("random", "structured", "file"):
            raise ValueError(f"unknown dataset {self.name!r} (random, structured, file:PATH)")
        if self.name == "file" and not self.path:
            raise ValueError("file dataset needs a path: file:PATH")
        if self.input_len < 1 or self.output_len < 1 or self.num_prompts < 1:
            raise ValueError("input_len, output_len and num_prompts must be positive")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")

    @classmethod
    def parse(cls, spec: str, **kw: object) -> DatasetSpec:
        """`random`, `structured` or `file:PATH`."""
        if spec.startswith("file:"):
            return cls(name="file", path=spec[len("file:") :], **kw)  # type: ignore[arg-type]
        return cls(name=spec, **kw)  # type: ignore[arg-type]


def _lengths(rng: random.Random, n: int, ratio: float) -> int:
    if ratio <= 0:
        return n
    lo, hi = max(1, int(n * (1 - ratio))), max(1, int(n * (1 + ratio)))
    return rng.randint(lo, hi)


def ordinary_id_limit(tok: Tokenizer, vocab_limit: int | None = None) -> int:
    """Ids below this are ordinary (non-special) tokens of the tokenizer and within the model's vocab."""
    first_special = tok.token_to_id("<|endoftext|>")
    limit = first_special if first_special is not None else tok.vocab_size
    if tok.eos_token_ids:
        limit = min(limit, min(tok.eos_token_ids))
    if vocab_limit is not None:
        limit = min(limit, vocab_limit)
    if limit < 2:
        raise ValueError("no ordinary token ids to draw from")
    return limit


def random_requests(spec: DatasetSpec, tok: Tokenizer) -> list[SampleRequest]:
    rng = random.Random(spec.seed)
    hi = ordinary_id_limit(tok, spec.vocab_limit)
    out = []
    for _ in range(spec.num_prompts):
        n_in = _lengths(rng, spec.input_len, spec.range_ratio)
        n_out = _lengths(rng, spec.output_len, spec.range_ratio)
        ids = tuple(rng.randrange(hi) for _ in range(n_in))
        out.append(SampleRequest(prompt_len=n_in, output_len=n_out, prompt_token_ids=ids))
    return out


# ---- structured text ------------------------------------------------------------------------------

_NAMES = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
_CITIES = ("Berlin", "Lisbon", "Osaka", "Lima", "Oslo", "Quito", "Perth", "Tunis")


def _json_records(rng: random.Random, start: int) -> str:
    rows = []
    for i in range(start, start + 8):
        rec = {
            "id": i,
            "name": f"{rng.choice(_NAMES)}_{i}",
            "city": rng.choice(_CITIES),
            "price": round(rng.uniform(1, 500), 2),
            "in_stock": rng.random() < 0.7,
            "tags": sorted(rng.sample(_NAMES, 2)),
        }
        rows.append(json.dumps(rec))
    return "\n".join(rows) + "\n"


def _csv_rows(rng: random.Random, start: int) -> str:
    rows = [
        f"{i},{rng.choice(_NAMES)},{rng.choice(_CITIES)},{rng.randint(1, 999)}"
        for i in range(start, start + 8)
    ]
    return "\n".join(rows) + "\n"


def _code_edit(rng: random.Random, start: int) -> str:
    name = rng.choice(_NAMES)
    field_name = rng.choice(("price", "count", "weight", "score"))
    factor = rng.randint(2, 9)
    return (
        f"def update_{name}_{start}(record: dict) -> dict:\n"
        f'    """Scale the {field_name} of a {name} record."""\n'
        f"    out = dict(record)\n"
        f'    out["{field_name}"] = record["{field_name}"] * {factor}\n'
        f'    out["version"] = record.get("version", 0) + 1\n'
        f"    return out\n\n"
    )


_HEADERS = (
    "Continue the JSON lines below with the next records in the same format.\n",
    "Continue the CSV table below (id,name,city,qty).\n",
    "Apply the same edit pattern to the next function.\n",
)


def structured_text(rng: random.Random, min_tokens: int, tok: Tokenizer) -> list[int]:
    """Token ids of one repetitive document with at least `min_tokens` tokens."""
    kind = rng.randrange(3)
    make = (_json_records, _csv_rows, _code_edit)[kind]
    ids = tok.encode(_HEADERS[kind])
    i = rng.randrange(1000)
    while len(ids) < min_tokens:
        ids.extend(tok.encode(make(rng, i)))
        i += 8
    return ids


def structured_requests(spec: DatasetSpec, tok: Tokenizer) -> list[SampleRequest]:
    rng = random.Random(spec.seed)
    out = []
    for _ in range(spec.num_prompts):
        n_in = _lengths(rng, spec.input_len, spec.range_ratio)
        n_out = _lengths(rng, spec.output_len, spec.range_ratio)
        ids = structured_text(rng, n_in, tok)[:n_in]
        if spec.vocab_limit is not None:
            ids = [t % spec.vocab_limit for t in ids]
        out.append(SampleRequest(prompt_len=n_in, output_len=n_out, prompt_token_ids=tuple(ids)))
    return out


def file_requests(spec: DatasetSpec, tok: Tokenizer) -> list[SampleRequest]:
    path = Path(str(spec.path))
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    out: list[SampleRequest] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        n_out = int(row.get("output_len") or spec.output_len)
        if "prompt_token_ids" in row:
            ids = tuple(int(t) for t in row["prompt_token_ids"])
            out.append(SampleRequest(prompt_len=len(ids), output_len=n_out, prompt_token_ids=ids))
        elif "prompt" in row:
            text = str(row["prompt"])
            out.append(SampleRequest(prompt_len=len(tok.encode(text)), output_len=n_out, prompt=text))
        else:
            raise ValueError(f"{path}:{lineno}: needs 'prompt' or 'prompt_token_ids'")
        if len(out) == spec.num_prompts:
            break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def load_requests(spec: DatasetSpec, tok: Tokenizer | None = None) -> list[SampleRequest]:
    """The dataset's requests; `tok` defaults to the Qwen3.6 tokenizer."""
    if tok is None:
        from metainfer.tokenizer import load_tokenizer

        tok = load_tokenizer(None)
    if spec.name == "random":
        return random_requests(spec, tok)
    if spec.name == "structured":
        return structured_requests(spec, tok)
    return file_requests(spec, tok)
