"""A fake OpenAI-compatible completions server with planted timing, for the bench tests.

Streams `max_tokens - short_by` one-token chunks: the first `ttft_ms` after the request arrives,
then one every `itl_ms`; the last chunk carries `usage` (unless `usage=False`). Every
`fail_every`-th request gets HTTP 500. Runs in a background thread (`FakeServer`) or as a script
(`python fake_openai.py --port P ...`, for `bench compare` tests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Behaviour:
    ttft_ms: float = 200.0
    itl_ms: float = 50.0
    short_by: int = 0
    fail_every: int = 0
    usage: bool = True
    finish_chunk: bool = False  # finish_reason in a separate empty-text chunk (not in the last token's)
    model: str = "fake-model"
    card: dict = field(default_factory=dict)  # further /v1/models facts (device, vocab_size, ...)


class FakeApp:
    def __init__(self, b: Behaviour) -> None:
        self.b = b
        self.count = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/completions", self.completions)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.b.model, "object": "model", **self.b.card}
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.count += 1
        if self.b.fail_every and self.count % self.b.fail_every == 0:
            return web.json_response({"error": {"message": "planted failure"}}, status=500)
        prompt = body["prompt"]
        n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        n_out = max(0, int(body["max_tokens"]) - self.b.short_by)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            t0 = time.perf_counter()
            for i in range(n_out):
                due = t0 + (self.b.ttft_ms + i * self.b.itl_ms) / 1000.0
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                finish = "length" if i == n_out - 1 and not self.b.finish_chunk else None
                chunk = {
                    "id": "cmpl-x",
                    "object": "text_completion",
                    "model": self.b.model,
                    "choices": [{"index": 0, "text": f" t{i}", "finish_reason": finish}],
                }
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.b.finish_chunk:
                chunk = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.b.usage:
                usage = {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": n_out,
                    "total_tokens": n_prompt + n_out,
                }
                await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.in_flight -= 1
        await resp.write_eof()
        return resp


class FakeServer:
    """The fake app on 127.0.0.1:`port` (0: a free one) in a background thread's event loop."""

    def __init__(self, b: Behaviour, port: int = 0) -> None:
        self.fake = FakeApp(b)
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._runner: web.AppRunner | None = None

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self.fake.app)
        self._loop.run_until_complete(self._runner.setup())
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self._loop.run_until_complete(web.SockSite(self._runner, sock).start())
        self._ready.set()
        self._loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--model", default="fake-model")
    a = p.parse_args()
    b = Behaviour(ttft_ms=a.ttft_ms, itl_ms=a.itl_ms, model=a.model)
    web.run_app(FakeApp(b).app, host="127.0.0.1", port=a.port, print=None)


if __name__ == "__main__":
    main()
