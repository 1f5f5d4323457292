"""POST /v1/chat/completions: the Qwen3.6 chat format (ChatML + think tags) x n choices, stream or not."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from metainfer.engine.request import TokenLogprob
from metainfer.server.async_engine import RequestGroup
from metainfer.server.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    error_body,
    now,
    random_id,
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
from metainfer.tokenizer import apply_chat_template


def render_chat_prompt(
    messages: list[ChatMessage], add_generation_prompt: bool, template_kwargs: dict | None
) -> str:
    """The prompt text for `messages`; APIError 400 for what the chat format refuses."""
    kwargs = template_kwargs or {}
    thinking = kwargs.get("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise APIError("chat_template_kwargs.enable_thinking must be a boolean", 400, "chat_template_kwargs")
    try:
        return apply_chat_template([m.model_dump() for m in messages], add_generation_prompt, thinking)
    except ValueError as e:
        raise APIError(str(e), 400, "messages") from None


def _logprobs(ctx: ServingContext, entries: list[TokenLogprob], k: int, as_ids: bool) -> ChatLogprobs:
    content = []
    for lp in entries:
        top = [
            TopLogprob(token=ctx.logprob_token(t, as_ids), logprob=clamp_logprob(v), bytes=ctx.token_bytes(t))
            for t, v in lp.top[:k]
        ]
        content.append(
            ChatTokenLogprob(
                token=ctx.logprob_token(lp.token_id, as_ids),
                logprob=clamp_logprob(lp.logprob),
                bytes=ctx.token_bytes(lp.token_id),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    """max_completion_tokens (else max_tokens, else the rest of the context) per choice; a stream opens
    each choice with a role delta. Raises APIError for what the request gets wrong."""
    ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
    prompt = render_chat_prompt(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
    ids = ctx.encode(prompt)
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, req.max_completion_tokens or req.max_tokens, k)
    rid = random_id("chatcmpl")
    group = await ctx.submit([(ids, p) for p in params], rid)
    created = now()
    if req.stream:
        gen = _stream(ctx, req, raw, group, rid, created, len(ids))
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    async with guarded(group, raw):
        async for _ in group:
            pass
    finals = [group.final[i] for i in group.ids]
    errors = [o.error for o in finals if o.finish_reason == "error"]
    if errors:
        raise APIError(errors[0] or "internal error", 500)
    choices = [
        ChatChoice(
            index=i,
            message=ChatResponseMessage(content=o.text),
            logprobs=_logprobs(ctx, o.logprobs or [], k, req.return_tokens_as_token_ids)
            if k is not None
            else None,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
        )
        for i, o in enumerate(finals)
    ]
    n_out = sum(len(o.token_ids) for o in finals)
    return json_response(
        ChatCompletionResponse(
            id=rid, created=created, model=ctx.model_name, choices=choices, usage=usage(len(ids), n_out)
        )
    )


async def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    raw: Request,
    group: RequestGroup,
    rid: str,
    created: int,
    n_prompt: int,
) -> AsyncIterator[str]:
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    k = (req.top_logprobs or 0) if req.logprobs else None
    counts = [0] * len(group.ids)

    def chunk(choice: ChatStreamChoice | None = None) -> ChatCompletionChunk:
        u = usage(n_prompt, sum(counts)) if continuous or choice is None else None
        return ChatCompletionChunk(
            id=rid, created=created, model=ctx.model_name, choices=[choice] if choice else [], usage=u
        )

    async with guarded(group, raw):
        for i in range(len(group.ids)):
            yield sse(chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))))
        async for out in group:
            if group.aborted and out.finish_reason == "abort":
                continue
            if out.finish_reason == "error":
                yield f"data: {json.dumps(error_body(out.error or 'internal error', 500))}\n\n"
                continue
            i = group.index[out.request_id]
            counts[i] = len(out.token_ids)
            lps = None
            if k is not None:
                lps = _logprobs(
                    ctx, new_logprobs(out.logprobs, len(out.new_token_ids)), k, req.return_tokens_as_token_ids
                )
            delta = DeltaMessage(content=out.new_text)
            yield sse(
                chunk(
                    ChatStreamChoice(
                        index=i,
                        delta=delta,
                        logprobs=lps,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                )
            )
        if group.aborted:
            return
        if include_usage:
            yield sse(chunk())
        yield SSE_DONE
