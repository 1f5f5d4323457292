"""Requests, their sampling parameters and what the engine hands back."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from metainfer.engine.grammar import Matcher, StructuredSpec
from metainfer.engine.sampler import LogitBias
from metainfer.tokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k <= 0 and top_p 1 disable those filters.
    logit_bias: (token id, value) pairs added to the logits before sampling, ids unique and sorted."""

    max_tokens: int | None = 16  # None: up to the model length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the sampled one)
    prompt_logprobs: int | None = None  # same for each prompt token (echo)
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured: StructuredSpec | None = None  # an output constraint (engine.grammar)
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        bias = dict(self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias)
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(v)) for t, v in bias.items())))
        if any(t < 0 or not math.isfinite(v) for t, v in self.logit_bias):
            raise ValueError("logit_bias needs non-negative token ids and finite values")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError("seed out of range")

    @property
    def greedy(self) -> bool:
        """The next token is the argmax of the model's own logits (temperature 0, no logit_bias)."""
        return self.temperature == 0.0 and not self.logit_bias


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved RNG seed
    max_tokens: int  # resolved against the model length
    eos_token_ids: tuple[int, ...]
    detokenizer: IncrementalDetokenizer | None = None
    score_only: bool = False  # teacher-forced scoring: keep every position's logits, generate nothing
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    score_logits: list = field(default_factory=list)  # score_only: [n, V] chunks, in order
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose KV / state are in the cache
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    # prefix caching (engine.cache): chain hashes of the sequence's full blocks so far, how many of
    # block_ids are indexed, snapshots taken but not keyed yet (position, slot, permanent, the drafts
    # of the verify it follows), the latest non-permanent snapshot keyed (slot, hash), and the
    # tokens its latest admission took from a prefix hit
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    pending_snapshots: list[tuple[int, int, bool, tuple[int, ...]]] = field(default_factory=list)
    moving_snapshot: tuple[int, int] | None = None
    num_cached_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # this step's speculative drafts
    grammar: Matcher | None = None  # params.structured's matcher (set when the request is added)
    logit_bias: LogitBias | None = None  # params.logit_bias as tensors (set when the request is added)
    spec_index: object = None  # the drafter's per-request state (spec.ngram.NgramIndex, spec.mtp.MTPState)
    spec_rejects: int = 0  # verifies in a row that accepted no draft
    spec_skip: int = 0  # drafting chances left to pass up (LLMEngine._note_acceptance)
    num_preemptions: int = 0
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    text: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def draftable(self) -> bool:
        """Speculative drafts may serve it: greedy, no logprobs, not a scoring request, no min_tokens
        ban pending (a verify's argmax would not apply it), no grammar (a verify applies no mask)."""
        p = self.params
        return (p.greedy and not self.score_only and p.logprobs is None and p.prompt_logprobs is None
                and len(self.output_token_ids) >= p.min_tokens and self.grammar is None)

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED


@dataclass
class RequestOutput:
    """A snapshot of one request after a step: cumulative outputs plus this step's delta."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    num_preemptions: int = 0
    ttft: float | None = None  # seconds from arrival to the first token
    e2e: float | None = None
    score_logits: object = None  # score requests: [L, V] fp32 tensor
