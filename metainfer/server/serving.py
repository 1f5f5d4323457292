"""What completions and chat share: the serving context, request -> SamplingParams, admission with
OpenAI error mapping, client-disconnect watching, token strings and SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError

from metainfer.engine.engine import RequestError
from metainfer.engine.grammar import StructuredSpec
from metainfer.engine.request import SamplingParams, TokenLogprob
from metainfer.server.async_engine import AsyncEngine, EngineClosed, Prompt, RequestGroup
from metainfer.server.metrics import ServerMetrics
from metainfer.server.protocol import APIError, SamplingFields, UsageInfo
from metainfer.server.structured import structured_spec

MAX_SUB_REQUESTS = 1024  # prompts x n in one API call
MAX_LOGIT_BIAS = 100.0  # logit_bias values are clamped to [-this, this] (OpenAI's range, vLLM's clamp)
LOGPROB_FLOOR = -9999.0  # -inf is not JSON
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p")


def generation_dir(setting: str, model_dir: Path) -> Path | None:
    """--generation-config: "auto" -> the model's folder, "vllm" -> None (vLLM's own defaults), else that
    folder."""
    if setting == "vllm":
        return None
    if setting == "auto":
        return model_dir
    return Path(setting).expanduser()


def load_generation_defaults(model_dir: Path | None) -> dict[str, float]:
    """Sampling defaults from the model's generation_config.json (vLLM's `--generation-config auto`)."""
    if model_dir is None:
        return {}
    f = model_dir / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        raw = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    return {k: raw[k] for k in SAMPLING_DEFAULT_KEYS if isinstance(raw.get(k), int | float)}


@dataclass
class ServingContext:
    """Everything a handler needs; built once per app."""

    engine: AsyncEngine
    tokenizer: Any
    served_model_names: list[str]
    max_model_len: int
    metrics: ServerMetrics
    vocab_size: int | None = None  # the model's token ids are < this (for clients that send ids)
    card: dict[str, Any] = field(default_factory=dict)  # further /v1/models facts (see `ModelCard`)
    defaults: dict[str, float] = field(default_factory=dict)
    max_logprobs: int = 20
    reasoning_parser: str = "qwen3"  # "qwen3": chat output split at </think>; "none": all content
    _token_strs: dict[int, str] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            raise APIError(f"The model `{name}` does not exist.", 404, "model")

    # ---- parameters ---------------------------------------------------------------------------
    def sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured: StructuredSpec | None = None,
    ) -> list[SamplingParams]:
        """One SamplingParams per choice (n); choice j gets seed + j when a seed is given (so a
        seeded n-choice request repeats, and its choice 0 is the same request with n = 1), each an
        independent engine request otherwise. The output constraint: `structured` when given, else
        the request's own (server.structured)."""
        _reject_unsupported(req)
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options can only be given when stream is true", 400, "stream_options")
        logit_bias = self.logit_bias(req.logit_bias)
        structured = structured or structured_spec(req)
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and value > self.max_logprobs:
                raise APIError(f"{name} must be at most {self.max_logprobs}, got {value}", 400, name)
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise APIError(
                f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})", 400, "min_tokens"
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        base: dict[str, Any] = {k: getattr(req, k) for k in SAMPLING_DEFAULT_KEYS}
        for k, v in base.items():
            if v is None:
                base[k] = self.defaults.get(k, SamplingParams.__dataclass_fields__[k].default)
        params = []
        for j in range(req.n):
            try:
                params.append(
                    SamplingParams(
                        max_tokens=max_tokens,
                        temperature=float(base["temperature"]),
                        top_p=float(base["top_p"]),
                        top_k=int(base["top_k"]),
                        min_p=float(base["min_p"]),
                        seed=None if req.seed is None else req.seed + j,
                        stop=tuple(stop),
                        stop_token_ids=tuple(req.stop_token_ids or ()),
                        ignore_eos=req.ignore_eos,
                        min_tokens=req.min_tokens,
                        include_stop_str_in_output=req.include_stop_str_in_output,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                        skip_special_tokens=req.skip_special_tokens,
                        structured=structured,
                        logit_bias=logit_bias,
                    )
                )
            except ValueError as e:
                raise APIError(str(e), 400) from None
        return params

    def logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's logit_bias ({"token id": value}) as (id, value) pairs, values clamped to
        [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]; APIError 400 naming logit_bias for a key that is not a
        token id of this model or a value that is not a number. The engine adds them to the logits
        before sampling, so a biased request's logprobs are those of the biased logits (vLLM
        reports the model's raw ones)."""
        out: dict[int, float] = {}
        for key, value in (bias or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise APIError(
                    f"logit_bias keys must be token ids (integers as strings), got {key!r}", 400, "logit_bias"
                ) from None
            if not 0 <= tid < (self.vocab_size or self.tokenizer.vocab_size):
                raise APIError(f"logit_bias token id {tid} is out of vocabulary", 400, "logit_bias")
            if math.isnan(value):
                raise APIError(f"logit_bias value for {key} is not a number", 400, "logit_bias")
            out[tid] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
        return tuple(out.items())

    def encode(self, text: str) -> list[int]:
        """Text -> token ids, on the event loop (the tokenizer is thread-safe; the engine is not)."""
        return list(self.tokenizer.encode(text))

    # ---- admission ----------------------------------------------------------------------------
    async def submit(self, items: Sequence[tuple[Prompt, SamplingParams]], prefix: str) -> RequestGroup:
        """Admits every item or raises APIError (400 for engine validation, 503 while shutting down)."""
        if len(items) > MAX_SUB_REQUESTS:
            raise APIError(f"at most {MAX_SUB_REQUESTS} prompts x n per request, got {len(items)}", 400, "n")
        try:
            return await self.engine.add(items, prefix)
        except EngineClosed as e:
            raise APIError(str(e), 503) from None
        except (RequestError, ValueError) as e:
            raise APIError(str(e), 400) from None

    # ---- tokens -------------------------------------------------------------------------------
    def token_str(self, token_id: int) -> str:
        """The text of one token (cached)."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            if len(self._token_strs) < 1 << 16:
                self._token_strs[token_id] = s
        return s

    def logprob_token(self, token_id: int, as_id: bool) -> str:
        """A token as logprobs show it: its text, or `token_id:N` (vLLM's return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if as_id else self.token_str(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        dec = getattr(self.tokenizer, "decode_bytes", None)
        raw = dec([token_id]) if dec is not None else self.token_str(token_id).encode()
        return list(raw)


def _reject_unsupported(req: SamplingFields) -> None:
    checks = (
        ("presence_penalty", req.presence_penalty not in (None, 0.0)),
        ("frequency_penalty", req.frequency_penalty not in (None, 0.0)),
        ("repetition_penalty", req.repetition_penalty not in (None, 1.0)),
    )
    for name, bad in checks:
        if bad:
            raise APIError(f"{name} is not supported by this server", 400, name)


def clamp_logprob(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR


def new_logprobs(out_logprobs: list[TokenLogprob] | None, n_new: int) -> list[TokenLogprob]:
    """The logprob entries of the tokens this output added."""
    if not out_logprobs or n_new <= 0:
        return []
    return out_logprobs[-n_new:]


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def to_json(model: BaseModel) -> str:
    """Pydantic's fast path; text that is not valid UTF-8 (lone surrogates echoed from the client)
    falls back to ASCII-escaped JSON."""
    try:
        return model.model_dump_json()
    except PydanticSerializationError:
        return json.dumps(model.model_dump(), ensure_ascii=True)


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(to_json(model), status_code=status, media_type="application/json")


# Line breaks to str.splitlines (and clients that split a stream with it, such as requests'
# iter_lines) that JSON leaves raw: escaped in events, so an event is one line to any reader
_SPLITLINES_ONLY = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def sse(model: BaseModel) -> str:
    """One server-sent event. JSON escapes \\r and \\n; U+0085, U+2028 and U+2029 (which generated
    text can hold) are escaped too: the SSE spec ends lines at CR/LF only, but splitlines-based
    readers would cut the event there."""
    data = to_json(model)
    for raw, esc in _SPLITLINES_ONLY.items():
        if raw in data:
            data = data.replace(raw, esc)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _abort_on_disconnect(request: Request, group: RequestGroup) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            group.abort()
            return


@contextlib.asynccontextmanager
async def guarded(group: RequestGroup, request: Request) -> AsyncIterator[RequestGroup]:
    """While the body runs, a client disconnect aborts the group; on exit anything unfinished is
    aborted (cancellation included) and the group stops counting as in flight."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, group))
    try:
        yield group
    finally:
        watcher.cancel()
        group.close()
