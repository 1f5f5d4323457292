"""Offline Python API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from metainfer.config import EngineConfig
from metainfer.engine.engine import LLMEngine
from metainfer.engine.request import RequestOutput, SamplingParams
from metainfer.tokenizer import apply_chat_template

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


class LLM:
    """Runs prompts to completion as one continuous batch.

    `model`: a HF model directory, `dummy:CONFIG_JSON` (seeded random weights), or "" for the
    embedded default model. Other keyword arguments are `EngineConfig` fields.
    """

    def __init__(self, model: str = "", progress: bool = False, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs), progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        items: list[str | Sequence[int]] = []
        if prompts is not None:
            items.extend([prompts] if isinstance(prompts, str) else prompts)
        if prompt_token_ids is not None:
            items.extend(prompt_token_ids)
        if not items:
            raise ValueError("no prompts given")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError("one SamplingParams per prompt, or one for all")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(items, params)]
        return self._run(ids)

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        enable_thinking: bool = True,
    ) -> RequestOutput:
        prompt = apply_chat_template(messages, add_generation_prompt=True, enable_thinking=enable_thinking)
        return self.generate(prompt, sampling_params)[0]

    @torch.inference_mode()
    def score(self, prompt_token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Teacher-forced logits: for each prompt, [L, V] fp32 (row i predicts token i+1).

        The prompts run as one continuous batch, chunked like any prefill."""
        ids = [
            self.engine.add_request(list(p), SamplingParams(max_tokens=1), score_only=True)
            for p in prompt_token_ids
        ]
        outs = self._run(ids)
        return [o.score_logits for o in outs]

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        pending = set(ids)
        while pending:
            if not self.engine.has_unfinished():
                raise RuntimeError(f"engine idle with {len(pending)} requests unfinished")
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
        return [final[i] for i in ids]
