"""`AsyncEngine`: the engine on its own thread, driven from asyncio.

Threading model:
- One engine thread owns the `LLMEngine` (which is not thread-safe) and is the only caller of it.
- Handlers submit commands (add a group of requests, abort ids) to an inbox guarded by a
  `threading.Condition`; the engine thread sleeps on it while there is neither a command nor
  unfinished work, so an idle server never spins.
- Admission results come back through an asyncio future, outputs through one asyncio queue per
  group; both are completed on the event loop with `loop.call_soon_threadsafe`.
- An exception escaping the engine (a step, an admission, an abort) fails the requests in flight
  (finish_reason "error"); the loop carries on.
- After every iteration the thread publishes an immutable `EngineSnapshot` for /metrics and /health.
- CPU engines: `cpu_threads` (torch's intra-op threads) is set on the engine thread, the only thread
  that should run torch ops. With a second thread's OpenMP team alive (say the main thread's, from
  building the model with several threads), libgomp throttles its spin-waits and every small op
  pays a thread wake-up.
  The server builds the engine with one thread, then gives the engine thread its count.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from metainfer.engine.request import RequestOutput, SamplingParams

log = logging.getLogger("metainfer.server")

Prompt = str | Sequence[int]


class EngineClosed(RuntimeError):
    """The engine no longer admits requests (shutting down or stopped)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine looked like after the last loop iteration."""

    num_running: int = 0
    num_waiting: int = 0
    num_inflight: int = 0  # requests the engine thread delivers outputs for
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    state_slots_used: int = 0
    state_slots_total: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_step_failures: int = 0
    spec_drafted: int = 0  # speculative draft tokens verified, and those accepted
    spec_accepted: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from it
    alive: bool = True


@dataclass
class _Add:
    ids: list[str]
    items: list[tuple[Prompt, SamplingParams]]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]
    future: asyncio.Future[None]


@dataclass
class _Abort:
    ids: list[str] | None  # None: everything in flight


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


def _resolve(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


class RequestGroup:
    """The engine requests of one API call (prompts x n); outputs arrive on one queue."""

    def __init__(self, engine: AsyncEngine, ids: list[str], queue: asyncio.Queue[RequestOutput]) -> None:
        self.engine = engine
        self.ids = ids
        self.queue = queue
        self.index = {rid: i for i, rid in enumerate(ids)}
        self.final: dict[str, RequestOutput] = {}
        self.aborted = False
        self._closed = False

    @property
    def done(self) -> bool:
        return len(self.final) == len(self.ids)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.done:
            out = await self.queue.get()
            if out.finished:
                self.final[out.request_id] = out
            yield out

    def abort(self) -> None:
        """Aborts every unfinished request of the group (idempotent); their final outputs still arrive."""
        if self._closed or self.done:
            return
        self.aborted = True
        self.engine.abort([rid for rid in self.ids if rid not in self.final])

    def close(self) -> None:
        """Aborts what is unfinished and stops counting the group as in flight."""
        self.abort()
        if not self._closed:
            self._closed = True
            self.engine._group_closed()


class AsyncEngine:
    """Runs an `LLMEngine` on a dedicated thread; `add()` and `abort()` are called from asyncio."""

    def __init__(
        self,
        engine: Any,
        on_output: Callable[[RequestOutput], None] | None = None,
        cpu_threads: int | None = None,
    ) -> None:
        self.engine = engine
        self.on_output = on_output
        self.cpu_threads = cpu_threads
        self.snapshot = EngineSnapshot(alive=False)
        self.accepting = True
        self._cv = threading.Condition()
        self._inbox: list[_Add | _Abort] = []
        self._stop = False
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._steps = 0
        self._failures = 0
        self._num_groups = 0  # event-loop side
        self._idle: asyncio.Event | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._publish()
        self._thread = threading.Thread(target=self._run, name="metainfer-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_groups(self) -> int:
        """API calls in flight (admitted and not yet closed)."""
        return self._num_groups

    async def drain(self, timeout: float) -> bool:
        """Stops admitting; waits up to `timeout` s for calls in flight; aborts the rest.

        Returns True when everything finished on its own."""
        self.accepting = False
        if self._num_groups:
            self._idle = self._idle or asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                pass
        clean = self._num_groups == 0
        if not clean:
            log.warning("grace period over: aborting %d request group(s)", self._num_groups)
            self.abort(None)
        return clean

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts everything in flight and joins the engine thread (blocking)."""
        self.accepting = False
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- event-loop side ----------------------------------------------------------------------
    async def add(self, items: Sequence[tuple[Prompt, SamplingParams]], prefix: str) -> RequestGroup:
        """Admits all `items` or none: the engine's validation error (`RequestError`) is raised here."""
        if not self.accepting or not self.alive:
            raise EngineClosed("the server is shutting down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        fut: asyncio.Future[None] = loop.create_future()
        ids = [f"{prefix}-{i}" for i in range(len(items))]
        self._submit(_Add(ids, list(items), loop, queue, fut))
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(ids)
            raise
        self._num_groups += 1
        return RequestGroup(self, ids, queue)

    def abort(self, ids: list[str] | None) -> None:
        """Aborts requests by id (None: all); safe from any thread."""
        self._submit(_Abort(list(ids) if ids is not None else None))

    def _group_closed(self) -> None:
        self._num_groups -= 1
        if self._num_groups == 0 and self._idle is not None:
            self._idle.set()

    def _submit(self, cmd: _Add | _Abort) -> None:
        with self._cv:
            if self._stop and isinstance(cmd, _Add):
                self._call(cmd.loop, _resolve, cmd.future, EngineClosed("the engine has stopped"))
                return
            self._inbox.append(cmd)
            self._cv.notify()

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        if self.cpu_threads:
            import torch

            torch.set_num_threads(self.cpu_threads)
        busy = False
        while True:
            with self._cv:
                while not self._inbox and not busy and not self._stop:
                    self._cv.wait()
                cmds, self._inbox = self._inbox, []
                stop = self._stop
            try:
                for cmd in cmds:
                    if isinstance(cmd, _Add):
                        self._admit(cmd)
                    else:
                        self._abort(list(self._streams) if cmd.ids is None else cmd.ids)
                if stop:
                    self._abort(list(self._streams))
                    self._publish(alive=False)
                    return
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                    self._steps += 1
                busy = self.engine.has_unfinished()
            except Exception as e:
                log.exception("engine loop failed; failing the requests in flight")
                self._failures += 1
                self._fail_all(f"internal engine error: {e}")
                busy = False
            self._publish()

    def _admit(self, cmd: _Add) -> None:
        added: list[str] = []
        try:
            for rid, (prompt, params) in zip(cmd.ids, cmd.items):
                self.engine.add_request(prompt, params, request_id=rid)
                added.append(rid)
        except Exception as e:
            for rid in added:
                self.engine.abort_request(rid)
            self._call(cmd.loop, _resolve, cmd.future, e)
            return
        if cmd.future.cancelled():
            for rid in added:
                self.engine.abort_request(rid)
            return
        for rid in added:
            self._streams[rid] = _Stream(cmd.loop, cmd.queue)
        self._call(cmd.loop, _resolve, cmd.future, None)

    def _abort(self, ids: list[str]) -> None:
        outs = []
        for rid in ids:
            if rid not in self._streams:
                continue
            out = self.engine.abort_request(rid)
            if out is None:  # not known to the engine: still end the stream
                out = RequestOutput(rid, [], [], "", [], "", True, "abort")
            outs.append(out)
        self._deliver(outs)

    def _fail_all(self, message: str) -> None:
        outs = []
        for rid in list(self._streams):
            try:
                out = self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
                out = None
            out = out or RequestOutput(rid, [], [], "", [], "", True, "error")
            outs.append(dataclasses.replace(out, finish_reason="error", error=message))
        self._deliver(outs)
        self._streams.clear()

    def _deliver(self, outs: list[RequestOutput]) -> None:
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]
        ] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            if out.logprobs is not None:
                out = dataclasses.replace(out, logprobs=list(out.logprobs))
            if self.on_output is not None:
                try:
                    self.on_output(out)
                except Exception:
                    log.exception("output observer failed")
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            self._call(loop, _put_all, items)

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    def _publish(self, alive: bool = True) -> None:
        e = self.engine
        usage = e.cache.usage()
        self.snapshot = EngineSnapshot(
            num_running=e.num_running,
            num_waiting=e.num_waiting,
            num_inflight=len(self._streams),
            kv_blocks_used=int(usage["kv_blocks_used"]),
            kv_blocks_total=int(usage["kv_blocks_total"]),
            state_slots_used=int(usage["state_slots_used"]),
            state_slots_total=int(usage["state_slots_total"]),
            num_preemptions=e.scheduler.num_preemptions,
            num_steps=self._steps,
            num_step_failures=self._failures,
            spec_drafted=e.stats["spec_drafted"],
            spec_accepted=e.stats["spec_accepted"],
            prefix_cache_queries=e.stats.get("prefix_cache_queries", 0),
            prefix_cache_hits=e.stats.get("prefix_cache_hits", 0),
            alive=alive,
        )
