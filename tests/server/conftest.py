"""A real uvicorn server on a free loopback port, in a background thread, over the default tiny model."""

from __future__ import annotations

import contextlib
import ctypes
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from metainfer.config import EngineConfig
from metainfer.engine.engine import LLMEngine
from metainfer.server.api import build_app, make_context
from metainfer.server.serving import ServingContext

MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 128
MODEL_NAME = "qwen-test"


def _keep_freed_memory() -> None:
    """glibc: keep large freed blocks instead of unmapping them (per-step [B, V] logits otherwise
    page-fault on every step, which dominates CPU step time on a loaded machine)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    base_url: str
    ctx: ServingContext
    engine: LLMEngine

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until the engine thread reports no request in flight and no cache in use."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.ctx.engine.snapshot
            if not (
                s.num_inflight or s.num_running or s.num_waiting or s.kv_blocks_used or s.state_slots_used
            ):
                return
            time.sleep(0.05)
        raise AssertionError(f"engine not idle after {timeout} s: {self.ctx.engine.snapshot}")


@pytest.fixture(scope="session")
def server() -> Iterator[LiveServer]:
    _keep_freed_memory()
    engine = LLMEngine(
        EngineConfig(device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS), progress=False
    )
    with live_server(engine) as live:
        yield live


@contextlib.contextmanager
def live_server(engine: Any, **context: Any) -> Iterator[LiveServer]:
    """`engine` (an LLMEngine or a stand-in with its interface) served on a free port until exit;
    `context`: further `make_context` arguments."""
    import uvicorn

    ctx = make_context(engine, [MODEL_NAME, "alias"], **context)
    app = build_app(ctx, shutdown_timeout=5.0)
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.05)
    live = LiveServer(f"http://127.0.0.1:{port}", ctx, engine)
    assert httpx.get(live.base_url + "/health").status_code == 200
    try:
        yield live
    finally:
        srv.should_exit = True
        thread.join(30)
    assert not ctx.engine.alive


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    """The official client on the shared server (a test module may define its own)."""
    c = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def n_tokens(server: LiveServer, text: str) -> int:
    return len(server.engine.tokenizer.encode(text))


@pytest.fixture
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c
