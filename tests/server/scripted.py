"""A stand-in for `LLMEngine` whose requests emit a scripted text, token by token: the server's parsing
of model output (reasoning, tool calls) tested end to end on known output."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from metainfer.engine.request import RequestOutput, SamplingParams
from metainfer.tokenizer import IncrementalDetokenizer, QwenTiktokenTokenizer


@dataclass
class _Running:
    prompt: list[int]
    script: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    done: int = 0


@dataclass
class ScriptedEngine:
    """Choice i of a request emits `scripts[i % len(scripts)]` (its tokens under the Qwen3.6
    tokenizer, special tokens included), `tokens_per_step` tokens a step, then stops as on EOS
    ("length" at max_tokens). `prompts` records every prompt as text."""

    scripts: list[str] = field(default_factory=lambda: ["Hello."])
    tokens_per_step: int = 1
    max_model_len: int = 4096
    prompts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokenizer = QwenTiktokenTokenizer()
        self.model_config = SimpleNamespace(
            vocab_size=self.tokenizer.vocab_size, hidden_size=8, num_hidden_layers=1, num_experts=1
        )
        self.scheduler = SimpleNamespace(num_preemptions=0)
        self.stats = {"spec_drafted": 0, "spec_accepted": 0}
        self.cache = SimpleNamespace(usage=self._usage)
        self.num_waiting = 0
        self._reqs: dict[str, _Running] = {}

    def _usage(self) -> dict[str, int]:
        n = len(self._reqs)
        return {"kv_blocks_used": n, "kv_blocks_total": 64, "state_slots_used": n, "state_slots_total": 64}

    @property
    def num_running(self) -> int:
        return len(self._reqs)

    def add_request(self, prompt: object, params: SamplingParams, request_id: str) -> str:
        ids = list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt)
        self.prompts.append(self.tokenizer.decode(ids))
        choice = int(request_id.rsplit("-", 1)[1])
        script = self.tokenizer.encode(self.scripts[choice % len(self.scripts)])
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self._reqs[request_id] = _Running(ids, script, params, detok)
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def step(self) -> list[RequestOutput]:
        outs = []
        for rid, r in list(self._reqs.items()):
            new = r.script[r.done : r.done + self.tokens_per_step]
            r.done += len(new)
            text = r.detok.add(new)
            limit = r.params.max_tokens
            reason = "length" if limit is not None and r.done >= limit else None
            if reason is None and r.done >= len(r.script):
                reason = "stop"
            if reason is not None:
                text += r.detok.flush()
                del self._reqs[rid]
            ids = r.script[: r.done]
            outs.append(
                RequestOutput(rid, r.prompt, ids, r.detok.text, new, text, reason is not None, reason)
            )
        return outs

    def abort_request(self, rid: str) -> RequestOutput | None:
        r = self._reqs.pop(rid, None)
        if r is None:
            return None
        return RequestOutput(rid, r.prompt, r.script[: r.done], r.detok.text, [], "", True, "abort")
