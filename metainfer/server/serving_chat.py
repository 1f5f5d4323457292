"""POST /v1/chat/completions: the Qwen3.6 chat format x n choices, stream or not; each choice's text
split into reasoning, content and tool calls (`chat_output`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from metainfer.engine.grammar import StructuredSpec
from metainfer.engine.request import TokenLogprob
from metainfer.server.async_engine import RequestGroup
from metainfer.server.chat_output import ChatEvent, ChoiceParser, TextDelta
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
    ChatTool,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    TopLogprob,
    error_body,
    now,
    random_id,
    reject_unsupported_fields,
)
from metainfer.server.reasoning import REASONING
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
from metainfer.server.structured import structured_spec, tool_call_spec
from metainfer.server.tool_parser import ToolCallArgs, ToolCallStart
from metainfer.tokenizer import THINK_START, apply_chat_template


def tool_dicts(tools: list[ChatTool] | None) -> list[dict] | None:
    """The tool definitions as the chat template renders them (the fields the client set)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def thinking_on(template_kwargs: dict | None) -> bool:
    thinking = (template_kwargs or {}).get("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise APIError("chat_template_kwargs.enable_thinking must be a boolean", 400, "chat_template_kwargs")
    return thinking


def render_chat_prompt(
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    template_kwargs: dict | None,
    tools: list[dict] | None = None,
) -> str:
    """The prompt text for `messages` (and `tools`); APIError 400 for what the chat format refuses."""
    thinking = thinking_on(template_kwargs)
    try:
        return apply_chat_template([m.model_dump() for m in messages], add_generation_prompt, thinking, tools)
    except ValueError as e:
        raise APIError(str(e), 400, "messages") from None


def parsed_tools(req: ChatCompletionRequest, tools: list[dict] | None) -> list[dict] | None:
    """The tools the output is parsed for calls of (None: no parsing); APIError 400 for a
    tool_choice the tools do not allow ("required" and a named function are forced by a grammar:
    `forced_tool_calls`)."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        names = [t["function"]["name"] for t in tools or ()]
        if choice.function.name not in names:
            raise APIError(
                f"tool_choice names the function `{choice.function.name}`, which is not in tools",
                400,
                "tool_choice",
            )
    elif choice == "required" and not tools:
        raise APIError('tool_choice "required" needs tools', 400, "tool_choice")
    return None if choice == "none" else tools


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


def _finish_reason(parser: ChoiceParser, reason: str | None) -> str | None:
    """The engine's finish reason, or "tool_calls" where the model ended its turn after calling tools
    (a length stop stays "length": the last call may be cut short)."""
    return "tool_calls" if parser.tool_calls and reason == "stop" else reason


def _message(parser: ChoiceParser) -> ChatResponseMessage:
    reasoning = parser.reasoning_text or None
    calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in parser.tool_calls
    ]
    content = parser.content if parser.content or not (reasoning or calls) else None
    return ChatResponseMessage(
        content=content, reasoning=reasoning, reasoning_content=reasoning, tool_calls=calls
    )


def _deltas(events: list[ChatEvent]) -> list[DeltaMessage]:
    """Stream deltas in order: text (reasoning, then content) shares a delta; each tool-call
    fragment is a delta of its own, as OpenAI streams them."""
    out: list[DeltaMessage] = []
    text: DeltaMessage | None = None
    for e in events:
        if isinstance(e, TextDelta):
            if text is None:
                text = DeltaMessage()
                out.append(text)
            if e.kind == REASONING:
                text.reasoning = text.reasoning_content = (text.reasoning or "") + e.text
            else:
                text.content = (text.content or "") + e.text
            continue
        text = None
        if isinstance(e, ToolCallStart):
            fn = DeltaFunctionCall(name=e.name, arguments="")
            out.append(
                DeltaMessage(tool_calls=[DeltaToolCall(index=e.index, id=e.id, type="function", function=fn)])
            )
        elif isinstance(e, ToolCallArgs):
            fn = DeltaFunctionCall(arguments=e.fragment)
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=e.index, function=fn)]))
    return out


def forced_tool_calls(req: ChatCompletionRequest, tools: list[dict] | None) -> StructuredSpec | None:
    """tool_choice "required" or a named function: the grammar that forces the call(s) (None
    otherwise); APIError 400 beside another output constraint."""
    choice = req.tool_choice
    if not tools or not (choice == "required" or isinstance(choice, NamedToolChoice)):
        return None
    if structured_spec(req) is not None:
        raise APIError("a forced tool call and an output constraint cannot be combined", 400, "tool_choice")
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return tool_call_spec(tools, name, parallel=name is None and req.parallel_tool_calls is not False)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    """max_completion_tokens (else max_tokens, else the rest of the context) per choice; a stream opens
    each choice with a role delta. Raises APIError for what the request gets wrong."""
    ctx.check_model(req.model)
    reject_unsupported_fields(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
    tools = tool_dicts(req.tools)
    parse_tools = parsed_tools(req, tools)
    prompt = render_chat_prompt(req.messages, req.add_generation_prompt, req.chat_template_kwargs, tools)
    split = ctx.reasoning_parser == "qwen3" and thinking_on(req.chat_template_kwargs)
    in_reasoning = prompt.rstrip().endswith(THINK_START)

    def new_parser() -> ChoiceParser:
        return ChoiceParser.for_request(
            split, in_reasoning, parse_tools, req.parallel_tool_calls is not False, req.include_reasoning
        )

    ids = ctx.encode(prompt)
    k = (req.top_logprobs or 0) if req.logprobs else None
    spec = forced_tool_calls(req, parse_tools) or structured_spec(req)
    if spec is not None and in_reasoning:  # the reasoning stays free, the constraint binds the answer
        spec = dataclasses.replace(spec, after_thinking=True)
    params = ctx.sampling_params(req, req.max_completion_tokens or req.max_tokens, k, structured=spec)
    rid = random_id("chatcmpl")
    group = await ctx.submit([(ids, p) for p in params], rid)
    created = now()
    if req.stream:
        parsers = [new_parser() for _ in params]
        gen = _stream(ctx, req, raw, group, rid, created, len(ids), parsers)
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    async with guarded(group, raw):
        async for _ in group:
            pass
    finals = [group.final[i] for i in group.ids]
    errors = [o.error for o in finals if o.finish_reason == "error"]
    if errors:
        raise APIError(errors[0] or "internal error", 500)
    choices = []
    for i, o in enumerate(finals):
        parser = new_parser()
        parser.feed(o.text)
        parser.finish()
        lps = _logprobs(ctx, o.logprobs or [], k, req.return_tokens_as_token_ids) if k is not None else None
        choices.append(
            ChatChoice(
                index=i,
                message=_message(parser),
                logprobs=lps,
                finish_reason=_finish_reason(parser, o.finish_reason),
                stop_reason=o.stop_reason,
            )
        )
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
    parsers: list[ChoiceParser],
) -> AsyncIterator[str]:
    """Every engine output gives at least one chunk (an empty delta when the parser holds its text
    back), the first of them with the output's logprobs, the last with its finish reason."""
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    k = (req.top_logprobs or 0) if req.logprobs else None
    counts = [0] * len(group.ids)

    def chunk(choice: ChatStreamChoice | None = None) -> ChatCompletionChunk:
        """A choice's chunk (with the prompt's and that choice's tokens' usage when continuous, as vLLM
        counts them), or the final usage chunk (the prompt once, every choice's tokens)."""
        if choice is None:
            u = usage(n_prompt, sum(counts))
        else:
            u = usage(n_prompt, counts[choice.index]) if continuous else None
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
            parser = parsers[i]
            events = parser.feed(out.new_text)
            if out.finished:
                events += parser.finish()
            deltas = _deltas(events) or [DeltaMessage()]
            finish = _finish_reason(parser, out.finish_reason)
            for j, delta in enumerate(deltas):
                last = j == len(deltas) - 1
                yield sse(
                    chunk(
                        ChatStreamChoice(
                            index=i,
                            delta=delta,
                            logprobs=lps if j == 0 else None,
                            finish_reason=finish if last else None,
                            stop_reason=out.stop_reason if last else None,
                        )
                    )
                )
        if group.aborted:
            return
        if include_usage:
            yield sse(chunk())
        yield SSE_DONE
