from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from metainfer.bench.datasets import DatasetSpec, SampleRequest, load_requests, ordinary_id_limit
from metainfer.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():  # the Qwen3.6 tokenizer
    return load_tokenizer(None)


def test_random_prompts_have_exact_length_and_ordinary_ids(tok) -> None:
    reqs = load_requests(DatasetSpec("random", 37, 5, 6, seed=1), tok)
    assert len(reqs) == 6
    limit = ordinary_id_limit(tok)
    assert limit == 248044  # first special token: <|endoftext|>
    for r in reqs:
        assert r.prompt_token_ids is not None and len(r.prompt_token_ids) == 37 == r.prompt_len
        assert r.output_len == 5 and all(0 <= t < limit for t in r.prompt_token_ids)
        assert r.payload_prompt == list(r.prompt_token_ids)


def test_random_is_deterministic_by_seed(tok) -> None:
    a = load_requests(DatasetSpec("random", 16, 4, 3, seed=7), tok)
    b = load_requests(DatasetSpec("random", 16, 4, 3, seed=7), tok)
    c = load_requests(DatasetSpec("random", 16, 4, 3, seed=8), tok)
    assert a == b and a != c
    assert len({r.prompt_token_ids for r in a}) == 3  # prompts differ from each other


def test_random_range_ratio_and_vocab_limit(tok) -> None:
    reqs = load_requests(DatasetSpec("random", 100, 20, 50, range_ratio=0.5, seed=0, vocab_limit=1000), tok)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert all(50 <= n <= 150 for n in ins) and len(set(ins)) > 10
    assert all(10 <= n <= 30 for n in outs)
    assert all(len(r.prompt_token_ids or ()) == r.prompt_len for r in reqs)
    assert max(t for r in reqs for t in r.prompt_token_ids or ()) < 1000


def test_structured_exact_length_deterministic_and_repetitive(tok) -> None:
    spec = DatasetSpec("structured", 300, 16, 6, seed=3)
    a, b = load_requests(spec, tok), load_requests(spec, tok)
    assert a == b
    assert a != load_requests(DatasetSpec("structured", 300, 16, 6, seed=4), tok)
    for r in a:
        ids = r.prompt_token_ids or ()
        assert len(ids) == 300 == r.prompt_len
        grams = Counter(tuple(ids[i : i + 3]) for i in range(len(ids) - 2))
        repeated = sum(c for c in grams.values() if c > 1) / sum(grams.values())
        assert repeated > 0.3, repeated  # high overlap: what n-gram speculation feeds on
    text = tok.decode(a[0].prompt_token_ids or ())
    assert text.startswith("Continue") or text.startswith("Apply")


def test_file_dataset(tmp_path: Path, tok) -> None:
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "Hello world, how are you?", "output_len": 7}, {"prompt_token_ids": [1, 2, 3]}, {}]
    f.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")
    reqs = load_requests(DatasetSpec.parse(f"file:{f}", input_len=1, output_len=9, num_prompts=10), tok)
    assert reqs[0] == SampleRequest(
        prompt_len=len(tok.encode(rows[0]["prompt"])), output_len=7, prompt=rows[0]["prompt"]
    )
    assert reqs[0].payload_prompt == rows[0]["prompt"]
    assert reqs[1] == SampleRequest(prompt_len=3, output_len=9, prompt_token_ids=(1, 2, 3))
    f.write_text(json.dumps(rows[2]) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        load_requests(DatasetSpec.parse(f"file:{f}", input_len=1, output_len=9, num_prompts=1), tok)
    with pytest.raises(FileNotFoundError):
        load_requests(
            DatasetSpec.parse(f"file:{tmp_path / 'none.jsonl'}", input_len=1, output_len=1, num_prompts=1),
            tok,
        )


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        DatasetSpec("sharegpt", 1, 1, 1)
    with pytest.raises(ValueError):
        DatasetSpec("random", 0, 1, 1)
    with pytest.raises(ValueError):
        DatasetSpec("random", 1, 1, 1, range_ratio=1.0)
    with pytest.raises(ValueError):
        SampleRequest(prompt_len=1, output_len=1)
