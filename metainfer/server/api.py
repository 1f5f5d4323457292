"""The FastAPI app: routes, OpenAI-style errors, API-key and shutdown guards, engine lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import metainfer
from metainfer.server.async_engine import AsyncEngine
from metainfer.server.metrics import ServerMetrics
from metainfer.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    error_body,
)
from metainfer.server.serving import ServingContext, json_response, load_generation_defaults
from metainfer.server.serving_chat import create_chat_completion, render_chat_prompt, tool_dicts
from metainfer.server.serving_completion import create_completion

log = logging.getLogger("metainfer.server")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
ALWAYS_OPEN = ("/metrics",)  # still answered while shutting down
ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse} for s in (400, 401, 404, 503)}


class ASCIIJSONResponse(JSONResponse):
    """Error bodies may quote client text; ASCII escapes keep lone surrogates encodable."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return ASCIIJSONResponse(error_body(message, status, param), status_code=status)


class GuardMiddleware:
    """Pure ASGI (streaming and disconnect detection untouched): 401 without the API key on /v1/*,
    503 for everything but /metrics once the server stops admitting."""

    def __init__(self, app: ASGIApp, ctx: ServingContext, api_key: str | None) -> None:
        self.app = app
        self.ctx = ctx
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if self.expected is not None and path.startswith("/v1"):
                got = dict(scope["headers"]).get(b"authorization", b"")
                if not hmac.compare_digest(got, self.expected):
                    await _error("Invalid or missing API key", 401)(scope, receive, send)
                    return
            if path not in ALWAYS_OPEN and not (self.ctx.engine.accepting and self.ctx.engine.alive):
                await _error("the server is shutting down", 503)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _where(loc: tuple[Any, ...]) -> str:
    """`body.prompt.list[int].3` -> `prompt.3`: drops the body prefix and pydantic's union/model tags."""
    parts = [
        str(x)
        for x in loc
        if x != "body" and not (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS or x[:1].isupper()))
    ]
    return ".".join(parts)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    first = errs[0]
    if first.get("type") == "json_invalid":
        return (
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')}",
            None,
        )
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "missing":
        return "a JSON object is required as the request body", None
    by_where: dict[str, list[str]] = {}
    for e in errs:
        msgs = by_where.setdefault(_where(tuple(e.get("loc", ()))) or "body", [])
        if e.get("msg", "invalid") not in msgs:
            msgs.append(e.get("msg", "invalid"))
    parts = [f"{w}: {' or '.join(m) if len(m) > 1 else m[0]}" for w, m in list(by_where.items())[:5]]
    more = f" (and {len(by_where) - 5} more)" if len(by_where) > 5 else ""
    param = next(iter(by_where))
    return "; ".join(parts) + more, None if param == "body" else param


def model_card_facts(engine: Any) -> dict[str, Any]:
    """The device and the model's shape, for /v1/models."""
    mc = engine.model_config
    facts: dict[str, Any] = {
        "hidden_size": mc.hidden_size,
        "num_hidden_layers": mc.num_hidden_layers,
        "num_experts": mc.num_experts,
    }
    device = getattr(getattr(engine, "runner", None), "device", None)
    if device is not None:
        facts["device"] = str(device)
        if getattr(device, "type", None) == "cuda":
            import torch

            facts["device"] += f" ({torch.cuda.get_device_name(device)})"
    return facts


def make_context(
    engine: Any,
    served_model_names: list[str],
    generation_config_dir: Path | None = None,
    max_logprobs: int = 20,
    cpu_threads: int | None = None,
    reasoning_parser: str = "qwen3",
) -> ServingContext:
    """Wraps an `LLMEngine` (not yet running) in an `AsyncEngine` with metrics (`cpu_threads`: see
    `AsyncEngine`)."""
    async_engine = AsyncEngine(engine, cpu_threads=cpu_threads)
    metrics = ServerMetrics(served_model_names[0], lambda: async_engine.snapshot)
    async_engine.on_output = metrics.observe
    return ServingContext(
        engine=async_engine,
        tokenizer=engine.tokenizer,
        served_model_names=list(served_model_names),
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        card=model_card_facts(engine),
        metrics=metrics,
        defaults=load_generation_defaults(generation_config_dir),
        max_logprobs=max_logprobs,
        reasoning_parser=reasoning_parser,
    )


def build_app(ctx: ServingContext, api_key: str | None = None, shutdown_timeout: float = 30.0) -> FastAPI:
    """The app for one engine. The lifespan starts the engine thread; its end drains and stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not ctx.engine.alive:
            ctx.engine.start()
        yield
        await ctx.engine.drain(shutdown_timeout)
        await asyncio.to_thread(ctx.engine.stop)

    app = FastAPI(
        title="MetaInfer OpenAI-compatible server", version=metainfer.__version__, lifespan=lifespan
    )
    app.state.ctx = ctx
    app.add_middleware(GuardMiddleware, ctx=ctx, api_key=api_key)

    def rejected(request: Request) -> None:
        if request.url.path in GENERATE_PATHS:
            ctx.metrics.rejected()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status < 500:
            rejected(request)
        return ASCIIJSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        rejected(request)
        message, param = _validation_message(exc)
        return _error(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code if 400 <= exc.status_code < 600 else 400
        return _error(str(exc.detail), status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error(f"internal server error: {type(exc).__name__}", 500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": metainfer.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        root = ctx.served_model_names[0]
        return ModelList(
            data=[
                ModelCard(
                    id=n, root=root, max_model_len=ctx.max_model_len, vocab_size=ctx.vocab_size, **ctx.card
                )
                for n in ctx.served_model_names
            ]
        )

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        ctx.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = render_chat_prompt(
                body.messages, body.add_generation_prompt, body.chat_template_kwargs, tool_dicts(body.tools)
            )
        else:
            text = body.prompt
        ids = ctx.encode(text)
        strs = [ctx.token_str(t) for t in ids] if body.return_token_strs else None
        return json_response(
            TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)
        )

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> Response:
        ctx.check_model(body.model)
        vocab = ctx.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is out of vocabulary [0, {vocab})", 400, "tokens")
        return json_response(DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens)))

    return app
