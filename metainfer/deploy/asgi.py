"""Runs one HTTP request through an in-process ASGI app (the replica's `build_app`) and yields its
response as picklable pieces: what a replica sends back to the ingress over a Ray stream. No Ray.

`AppRunner.forward(req)` yields one `ResponseHead`, then `bytes` chunks: every body message the app
has sent by the time the consumer asks for more, joined (so a slow consumer gets fewer, larger
items). With `stream_interval_s` > 0, body chunks after the first are at least that far apart (what
arrives meanwhile is joined): fewer, larger items through Ray at the price of burstier streams.
Cancelling the generator (the ingress gone, the client disconnected) makes the app's
`receive()` return `http.disconnect`, which is how `build_app`'s handlers notice a client leaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("metainfer.deploy")

_END = object()


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it (whole body read)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]  # lower-case names, as ASGI gives them
    body: bytes
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


class AppRunner:
    """Owns an ASGI app's lifespan (startup before the first request, shutdown on `stop`)."""

    def __init__(
        self, app: Any, extra_headers: list[tuple[bytes, bytes]] | None = None, stream_interval_s: float = 0.0
    ) -> None:
        self.app = app
        self.extra_headers = list(extra_headers or [])
        self.stream_interval_s = stream_interval_s
        self._lifespan_in: asyncio.Queue[dict[str, Any]] | None = None
        self._lifespan_out: asyncio.Queue[dict[str, Any]] | None = None
        self._lifespan_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Runs the app's lifespan startup; raises if the app reports it failed."""
        self._lifespan_in, self._lifespan_out = asyncio.Queue(), asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self._lifespan_task = asyncio.create_task(
            self.app(scope, self._lifespan_in.get, self._lifespan_out.put)
        )
        await self._lifespan_in.put({"type": "lifespan.startup"})
        msg = await self._lifespan_out.get()
        if msg["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app failed to start: {msg.get('message', msg['type'])}")

    async def stop(self) -> None:
        """Runs the lifespan shutdown (`build_app`'s: drain the engine, then stop it)."""
        if self._lifespan_task is None or self._lifespan_in is None or self._lifespan_out is None:
            return
        await self._lifespan_in.put({"type": "lifespan.shutdown"})
        with contextlib.suppress(Exception):
            await self._lifespan_out.get()
            await self._lifespan_task
        self._lifespan_task = None

    async def forward(self, req: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The app's response to `req`: one `ResponseHead`, then body chunks (see the module doc)."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": req.method,
            "scheme": "http",
            "path": req.path,
            "raw_path": req.path.encode(),
            "root_path": "",
            "query_string": req.query_string,
            "headers": list(req.headers),
            "client": req.client,
            "server": None,
        }
        out: asyncio.Queue[Any] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def run() -> None:
            try:
                await self.app(scope, receive, out.put)
            except Exception as e:  # the app's own 500 (if any) is already queued
                log.exception("app failed on %s", req.path)
                out.put_nowait(e)
            finally:
                out.put_nowait(_END)

        task = asyncio.create_task(run())
        loop = asyncio.get_running_loop()
        last_yield: float | None = None  # loop time of the last body chunk sent
        interval = self.stream_interval_s
        started = False
        pending: Any = None  # a message taken off the queue while joining body chunks
        try:
            while True:
                msg, pending = (pending if pending is not None else await out.get()), None
                if msg is _END or isinstance(msg, Exception):
                    if not started:
                        from metainfer.server.protocol import error_body

                        yield ResponseHead(500, [(b"content-type", b"application/json"), *self.extra_headers])
                        yield json.dumps(error_body("internal server error", 500)).encode()
                    return
                if msg["type"] == "http.response.start":
                    started = True
                    headers = [(bytes(k), bytes(v)) for k, v in msg.get("headers", [])]
                    yield ResponseHead(msg["status"], headers + self.extra_headers)
                    continue
                if msg["type"] != "http.response.body":
                    continue
                chunks, more = [msg.get("body", b"")], msg.get("more_body", False)
                while more:
                    if not out.empty():
                        nxt = out.get_nowait()
                    elif last_yield is not None and (left := last_yield + interval - loop.time()) > 0:
                        try:
                            nxt = await asyncio.wait_for(out.get(), left)
                        except TimeoutError:
                            break
                    else:
                        break
                    if not isinstance(nxt, dict) or nxt["type"] != "http.response.body":
                        pending = nxt
                        break
                    chunks.append(nxt.get("body", b""))
                    more = nxt.get("more_body", False)
                data = b"".join(chunks)
                if data:
                    yield data
                    last_yield = loop.time()
                if not more:
                    return
        finally:
            gone.set()
            if not task.done():
                # the app sees the disconnect and ends its handler; never left running unowned
                task.add_done_callback(lambda t: t.cancelled() or t.exception())

