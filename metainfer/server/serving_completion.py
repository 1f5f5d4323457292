"""POST /v1/completions: prompts (text or token ids, one or many) x n choices, stream or not."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from metainfer.engine.request import RequestOutput, TokenLogprob
from metainfer.server.async_engine import RequestGroup
from metainfer.server.protocol import (
    APIError,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    error_body,
    now,
    random_id,
    reject_unsupported_fields,
)
from metainfer.server.serving import (
    SSE_DONE,
    SSE_HEADERS,
    ServingContext,
    clamp_logprob,
    guarded,
    json_response,
    new_logprobs,
    sse,
    usage,
)


@dataclass
class _Prompt:
    text: str | None  # None: given as token ids
    ids: list[int]


@dataclass
class _Choice:
    prompt: _Prompt
    offset: int = 0  # characters of this choice's text already sent (logprobs text_offset)
    started: bool = False
    num_tokens: int = 0  # completion tokens sent
    prompt_only: bool = False  # echo with max_tokens 0: the engine's token is never shown


def _prompts(ctx: ServingContext, prompt: str | list[str] | list[int] | list[list[int]]) -> list[_Prompt]:
    if isinstance(prompt, str):
        return [_Prompt(prompt, ctx.encode(prompt))]
    if not prompt:
        raise APIError("prompt must not be empty", 400, "prompt")
    if isinstance(prompt[0], int):
        return [_Prompt(None, list(prompt))]  # type: ignore[arg-type]
    out = []
    for p in prompt:
        out.append(_Prompt(p, ctx.encode(p)) if isinstance(p, str) else _Prompt(None, list(p)))
    return out


def _logprobs(
    ctx: ServingContext,
    token_ids: list[int],
    lps: list[TokenLogprob | None],
    offset: int,
    k: int,
    as_ids: bool,
) -> tuple[CompletionLogprobs, int]:
    """Legacy completions logprobs for `token_ids` (entries None: no logprob, e.g. the first prompt token)."""
    res = CompletionLogprobs()
    for tid, lp in zip(token_ids, lps):
        s = ctx.logprob_token(tid, as_ids)
        res.tokens.append(s)
        res.text_offset.append(offset)
        offset += len(ctx.token_str(tid))
        if lp is None:
            res.token_logprobs.append(None)
            res.top_logprobs.append(None)
            continue
        res.token_logprobs.append(clamp_logprob(lp.logprob))
        top = {ctx.logprob_token(t, as_ids): clamp_logprob(v) for t, v in lp.top[:k]}
        top.setdefault(s, clamp_logprob(lp.logprob))
        res.top_logprobs.append(top)
    return res, offset


def _echo_text(ctx: ServingContext, p: _Prompt) -> str:
    return p.text if p.text is not None else ctx.tokenizer.decode(p.ids)


def _echo_logprobs(out: RequestOutput) -> list[TokenLogprob | None]:
    lps = list(out.prompt_logprobs or [])
    return lps + [None] * (len(out.prompt_token_ids) - len(lps))


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    """Choice i*n + j is prompt i's j-th sample; usage counts each prompt once and every choice's tokens.
    echo with max_tokens 0 (vLLM's): each choice is its prompt alone (with its prompt logprobs), no
    completion tokens. Raises APIError for what the request gets wrong."""
    ctx.check_model(req.model)
    reject_unsupported_fields(req)
    if req.suffix:
        raise APIError("suffix is not supported", 400, "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(
            f"best_of must equal n ({req.n}): ranking extra samples is not supported", 400, "best_of"
        )
    prompt_only = req.max_tokens == 0
    if prompt_only and not req.echo:
        raise APIError("max_tokens must be at least 1 (0 only with echo)", 400, "max_tokens")
    prompts = _prompts(ctx, req.prompt)
    echo_lp = req.logprobs if req.echo and req.logprobs is not None else None
    max_tokens = 1 if prompt_only else req.max_tokens  # (prompt_only: the one token is dropped)
    params = ctx.sampling_params(req, max_tokens, req.logprobs, echo_lp)
    choices = [_Choice(p, prompt_only=prompt_only) for p in prompts for _ in params]
    rid = random_id("cmpl")
    group = await ctx.submit([(c.prompt.ids, sp) for c, sp in zip(choices, params * len(prompts))], rid)
    created = now()
    n_prompt = sum(len(p.ids) for p in prompts)
    if req.stream:
        gen = _stream(ctx, req, raw, group, choices, rid, created, n_prompt)
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    async with guarded(group, raw):
        async for _ in group:
            pass
    finals = [group.final[i] for i in group.ids]
    errors = [o.error for o in finals if o.finish_reason == "error"]
    if errors:
        raise APIError(errors[0] or "internal error", 500)
    out_choices = []
    for i, (c, o) in enumerate(zip(choices, finals)):
        text, lps, finish, stop_reason = o.text, None, o.finish_reason, o.stop_reason
        if c.prompt_only:
            o = dataclasses.replace(o, token_ids=[], text="", logprobs=[])
            text, finish, stop_reason = "", "length", None
        if req.logprobs is not None:
            ids, entries = list(o.token_ids), list(o.logprobs or [])
            if req.echo:
                ids, entries = list(o.prompt_token_ids) + ids, _echo_logprobs(o) + entries
            lps, _ = _logprobs(ctx, ids, entries, 0, req.logprobs, req.return_tokens_as_token_ids)
        if req.echo:
            text = _echo_text(ctx, c.prompt) + text
        c.num_tokens = len(o.token_ids)
        out_choices.append(
            CompletionChoice(index=i, text=text, logprobs=lps, finish_reason=finish, stop_reason=stop_reason)
        )
    n_out = sum(c.num_tokens for c in choices)
    return json_response(
        CompletionResponse(
            id=rid, created=created, model=ctx.model_name, choices=out_choices, usage=usage(n_prompt, n_out)
        )
    )


async def _stream(
    ctx: ServingContext,
    req: CompletionRequest,
    raw: Request,
    group: RequestGroup,
    choices: list[_Choice],
    rid: str,
    created: int,
    n_prompt: int,
) -> AsyncIterator[str]:
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)

    def chunk(choice: CompletionChoice | None = None) -> CompletionResponse:
        """A choice's chunk (with its own prompt's and its own tokens' usage when continuous, as vLLM
        counts them), or the final usage chunk (every prompt once, every choice's tokens)."""
        if choice is None:
            u = usage(n_prompt, sum(c.num_tokens for c in choices))
        else:
            c = choices[choice.index]
            u = usage(len(c.prompt.ids), c.num_tokens) if continuous else None
        return CompletionResponse(
            id=rid, created=created, model=ctx.model_name, choices=[choice] if choice else [], usage=u
        )

    async with guarded(group, raw):
        async for out in group:
            if group.aborted and out.finish_reason == "abort":
                continue
            if out.finish_reason == "error":
                yield f"data: {json.dumps(error_body(out.error or 'internal error', 500))}\n\n"
                continue
            i = group.index[out.request_id]
            c = choices[i]
            finish, stop_reason = out.finish_reason, out.stop_reason
            if c.prompt_only:
                if not out.finished:
                    continue
                out = dataclasses.replace(out, token_ids=[], new_token_ids=[], new_text="")
                finish, stop_reason = "length", None
            c.num_tokens = len(out.token_ids)
            text, ids = out.new_text, list(out.new_token_ids)
            entries: list[TokenLogprob | None] = list(new_logprobs(out.logprobs, len(ids)))
            if req.echo and not c.started:
                text = _echo_text(ctx, c.prompt) + text
                ids, entries = list(out.prompt_token_ids) + ids, _echo_logprobs(out) + entries
            c.started = True
            lps = None
            if req.logprobs is not None:
                lps, c.offset = _logprobs(
                    ctx, ids, entries, c.offset, req.logprobs, req.return_tokens_as_token_ids
                )
            yield sse(
                chunk(
                    CompletionChoice(
                        index=i,
                        text=text,
                        logprobs=lps,
                        finish_reason=finish,
                        stop_reason=stop_reason,
                    )
                )
            )
        if group.aborted:
            return
        if include_usage:
            yield sse(chunk())
        yield SSE_DONE
