"""AsyncEngine threading contract, on a fake engine: streaming, all-or-nothing admission, aborts, a
step that raises, no busy loop when idle, drain and stop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest

from metainfer.engine.engine import RequestError
from metainfer.engine.request import RequestOutput, SamplingParams
from metainfer.server.async_engine import AsyncEngine, EngineClosed, RequestGroup


class FakeEngine:
    """Each request emits one token per step until max_tokens; prompt "bad" is refused."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.reqs: dict[str, list[int]] = {}
        self.step_s = step_s
        self.steps = 0
        self.checks = 0
        self.fail_next = 0
        self.num_waiting = 0
        self.scheduler = SimpleNamespace(num_preemptions=0)
        self.stats = {"spec_drafted": 0, "spec_accepted": 0}  # the LLMEngine counters the snapshot reads
        self.cache = SimpleNamespace(
            usage=lambda: {
                "kv_blocks_used": len(self.reqs),
                "kv_blocks_total": 64,
                "state_slots_used": len(self.reqs),
                "state_slots_total": 8,
            }
        )

    @property
    def num_running(self) -> int:
        return len(self.reqs)

    def add_request(self, prompt: object, params: SamplingParams, request_id: str) -> str:
        if prompt == "bad":
            raise RequestError("bad prompt")
        self.reqs[request_id] = [0, params.max_tokens or 1]
        return request_id

    def has_unfinished(self) -> bool:
        self.checks += 1
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        time.sleep(self.step_s)
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("boom")
        outs = []
        for rid, st in list(self.reqs.items()):
            st[0] += 1
            done = st[0] >= st[1]
            outs.append(
                RequestOutput(rid, [1], [7] * st[0], "x" * st[0], [7], "x", done, "length" if done else None)
            )
            if done:
                del self.reqs[rid]
        return outs

    def abort_request(self, rid: str) -> RequestOutput | None:
        st = self.reqs.pop(rid, None)
        if st is None:
            return None
        return RequestOutput(rid, [1], [7] * st[0], "x" * st[0], [], "", True, "abort")


def run(coro_fn: Callable[[AsyncEngine, FakeEngine], Awaitable[None]]) -> None:
    fake = FakeEngine()
    ae = AsyncEngine(fake)
    ae.start()
    try:
        asyncio.run(coro_fn(ae, fake))
    finally:
        ae.stop()
        assert not ae.alive


def test_streams_outputs_and_sleeps_when_idle() -> None:
    async def body(ae: AsyncEngine, fake: FakeEngine) -> None:
        group = await ae.add([("a", SamplingParams(max_tokens=3)), ("b", SamplingParams(max_tokens=5))], "g")
        seen = [out async for out in group]
        assert len(seen) == 8 and group.done
        assert {r: len(o.token_ids) for r, o in group.final.items()} == {"g-0": 3, "g-1": 5}
        group.close()
        await asyncio.sleep(0.05)
        steps, checks = fake.steps, fake.checks
        await asyncio.sleep(0.3)
        assert (fake.steps, fake.checks) == (steps, checks), "the idle engine thread must sleep"
        assert ae.snapshot.num_inflight == 0 and ae.snapshot.kv_blocks_used == 0 and ae.num_groups == 0

    run(body)


def test_admission_is_all_or_nothing() -> None:
    async def body(ae: AsyncEngine, fake: FakeEngine) -> None:
        with pytest.raises(RequestError, match="bad prompt"):
            await ae.add([("ok", SamplingParams(max_tokens=50)), ("bad", SamplingParams())], "g")
        await asyncio.sleep(0.05)
        assert fake.reqs == {} and ae.num_groups == 0

    run(body)


def test_step_exception_fails_requests_and_loop_survives() -> None:
    async def body(ae: AsyncEngine, fake: FakeEngine) -> None:
        fake.fail_next = 1
        group = await ae.add([("a", SamplingParams(max_tokens=4))], "g")
        outs = [o async for o in group]
        group.close()
        assert outs[-1].finish_reason == "error" and "boom" in (outs[-1].error or "")
        assert fake.reqs == {}
        again = await ae.add([("a", SamplingParams(max_tokens=2))], "h")
        assert [o.finish_reason async for o in again][-1] == "length"
        again.close()
        assert ae.snapshot.num_step_failures == 1 and ae.alive

    run(body)


def test_abort_frees_at_once() -> None:
    async def body(ae: AsyncEngine, fake: FakeEngine) -> None:
        group = await ae.add([("a", SamplingParams(max_tokens=10_000))], "g")
        async for out in group:
            if not out.finished and len(out.token_ids) >= 2:
                group.abort()
        group.close()
        assert group.final["g-0"].finish_reason == "abort" and group.aborted
        assert fake.reqs == {}

    run(body)


def test_cancelled_handler_aborts_its_requests() -> None:
    async def body(ae: AsyncEngine, fake: FakeEngine) -> None:
        async def handler() -> None:
            group = await ae.add([("a", SamplingParams(max_tokens=10_000))], "g")
            try:
                async for _ in group:
                    pass
            finally:
                group.close()

        task = asyncio.create_task(handler())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert fake.reqs == {} and ae.num_groups == 0

    run(body)


def test_drain_finishes_or_aborts_within_grace() -> None:
    async def body(ae: AsyncEngine, fake: FakeEngine) -> None:
        short = await ae.add([("a", SamplingParams(max_tokens=3))], "s")
        long = await ae.add([("a", SamplingParams(max_tokens=100_000))], "l")

        async def consume(group: RequestGroup) -> str | None:
            outs = [o async for o in group]
            group.close()
            return outs[-1].finish_reason

        tasks = [asyncio.create_task(consume(g)) for g in (short, long)]
        t0 = time.monotonic()
        clean = await ae.drain(0.3)
        assert not clean and 0.25 < time.monotonic() - t0 < 2.0
        assert await asyncio.gather(*tasks) == ["length", "abort"]
        with pytest.raises(EngineClosed):
            await ae.add([("a", SamplingParams())], "x")
        assert fake.reqs == {}

    run(body)


def test_drain_clean_and_stop_ends_streams() -> None:
    async def body(ae: AsyncEngine, fake: FakeEngine) -> None:
        g = await ae.add([("a", SamplingParams(max_tokens=3))], "g")
        outs = asyncio.create_task(asyncio.wait_for(_collect(g), 5))
        assert await ae.drain(5.0)
        assert (await outs)[-1] == "length"
        await asyncio.to_thread(ae.stop)
        assert not ae.alive and not ae.snapshot.alive

    run(body)


async def _collect(group: RequestGroup) -> list[str | None]:
    out = [o.finish_reason async for o in group]
    group.close()
    return out


def test_cpu_threads_are_set_on_the_engine_thread() -> None:
    """`cpu_threads`: the engine thread sets torch's intra-op thread count itself (the server builds
    a CPU engine with one thread so that only the engine thread forms an OpenMP team)."""
    import torch

    from metainfer.config import EngineConfig
    from metainfer.server.cli import _engine_thread_only

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # a count the engine thread must get back (the suite runs with one)
        assert _engine_thread_only(EngineConfig(device="cpu")) == 2 and torch.get_num_threads() == 1
        seen = []
        fake = FakeEngine()
        fake.has_unfinished = lambda: seen.append(torch.get_num_threads()) or False  # the engine thread
        ae = AsyncEngine(fake, cpu_threads=2)
        ae.start()
        ae.abort([])  # wakes the loop once
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        ae.stop()
        assert seen and seen[0] == 2
    finally:
        torch.set_num_threads(before)
