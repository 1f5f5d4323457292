"""`AppRunner`: the replica side of a forwarded request, on the real `build_app` over a scripted engine
(no Ray, no model): lifespan, plain and streamed answers as one head then body chunks, errors, and a
consumer that goes away aborting the engine's requests."""

from __future__ import annotations

import asyncio
import json
import time

from metainfer.deploy.asgi import AppRunner, ForwardedRequest, ResponseHead
from metainfer.server.api import build_app, make_context
from tests.server.scripted import ScriptedEngine

HEADERS = [(b"content-type", b"application/json"), (b"host", b"test")]


class SlowEngine(ScriptedEngine):
    def step(self):  # a step takes 5 ms: a long script streams for seconds
        time.sleep(0.005)
        return super().step()


def _post(path: str, body: dict, headers=HEADERS) -> ForwardedRequest:
    return ForwardedRequest("POST", path, b"", list(headers), json.dumps(body).encode(), ("127.0.0.1", 1))


async def _collect(runner: AppRunner, req: ForwardedRequest) -> tuple[ResponseHead, bytes, int]:
    items = [x async for x in runner.forward(req)]
    head, chunks = items[0], items[1:]
    assert isinstance(head, ResponseHead) and all(isinstance(c, bytes) for c in chunks)
    return head, b"".join(chunks), len(chunks)


def test_forward_answers_like_the_server() -> None:
    async def main() -> None:
        engine = ScriptedEngine(scripts=["Hello there, world."])
        ctx = make_context(engine, ["m"])
        runner = AppRunner(build_app(ctx, api_key="k"), extra_headers=[(b"x-metainfer-replica", b"r1")])
        await runner.start()
        assert ctx.engine.alive
        auth = [*HEADERS, (b"authorization", b"Bearer k")]
        head, body, _ = await _collect(runner, _post("/v1/completions", {"model": "m", "prompt": "hi"}, auth))
        assert head.status == 200 and head.header(b"x-metainfer-replica") == b"r1"
        assert json.loads(body)["choices"][0]["text"] == "Hello there, world."

        req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        head, body, _ = await _collect(runner, _post("/v1/chat/completions", req, auth))
        assert head.status == 200 and head.header(b"content-type").startswith(b"text/event-stream")
        events = [e for e in body.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and len(events) > 3

        head, body, _ = await _collect(runner, _post("/v1/completions", {"model": "m", "prompt": "hi"}))
        assert head.status == 401
        bad = {"model": "m", "prompt": "hi", "max_tokens": -1}
        head, body, _ = await _collect(runner, _post("/v1/completions", bad, auth))
        assert head.status == 400 and json.loads(body)["error"]["param"] == "max_tokens"
        await runner.stop()
        assert not ctx.engine.alive

    asyncio.run(main())


def test_a_consumer_that_leaves_aborts_its_requests() -> None:
    async def main() -> None:
        engine = SlowEngine(scripts=["word " * 2000])
        ctx = make_context(engine, ["m"])
        runner = AppRunner(build_app(ctx))
        await runner.start()
        req = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 2000}
        gen = runner.forward(_post("/v1/completions", req))
        assert (await gen.__anext__()).status == 200
        assert b"data: " in await gen.__anext__()
        assert ctx.engine.snapshot.num_inflight == 1
        await gen.aclose()
        for _ in range(750):  # up to 15 s on a loaded machine
            if ctx.engine.snapshot.num_inflight == 0 and not engine.has_unfinished():
                break
            await asyncio.sleep(0.02)
        assert ctx.engine.snapshot.num_inflight == 0 and not engine.has_unfinished()
        await runner.stop()

    asyncio.run(main())


def test_an_app_that_fails_before_answering_is_a_500() -> None:
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        raise RuntimeError("boom")

    async def main() -> None:
        runner = AppRunner(app)
        await runner.start()
        head, body, _ = await _collect(runner, _post("/v1/completions", {}))
        assert head.status == 500 and json.loads(body)["error"]["type"] == "InternalServerError"
        await runner.stop()

    asyncio.run(main())


def test_a_stream_interval_joins_chunks_after_the_first() -> None:
    async def app(scope, receive, send):  # 20 events 5 ms apart
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(20):
            await send({"type": "http.response.body", "body": b"e%d;" % i, "more_body": True})
            await asyncio.sleep(0.005)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main(interval: float) -> list[bytes]:
        runner = AppRunner(app, stream_interval_s=interval)
        await runner.start()
        items = [x async for x in runner.forward(_post("/x", {}))]
        await runner.stop()
        return items[1:]

    plain, joined = asyncio.run(main(0.0)), asyncio.run(main(0.04))
    everything = b"".join(f"e{i};".encode() for i in range(20))
    assert b"".join(plain) == b"".join(joined) == everything
    assert joined[0] == b"e0;" and len(joined) <= 6 < len(plain)  # ~100 ms in 40 ms windows
