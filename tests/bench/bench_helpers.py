"""Small helpers shared by the bench tests."""

from __future__ import annotations

from metainfer.bench.datasets import SampleRequest


def id_requests(n: int, input_len: int, output_len: int) -> list[SampleRequest]:
    """`n` identical token-id prompts of `input_len` tokens asking for `output_len` tokens."""
    ids = tuple(range(1, input_len + 1))
    return [
        SampleRequest(prompt_len=input_len, output_len=output_len, prompt_token_ids=ids) for _ in range(n)
    ]
