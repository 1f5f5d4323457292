"""`metainfer serve`: the OpenAI-compatible HTTP server (flags named as `vllm serve` names them).

One process: uvicorn's event loop on the main thread, the engine on its own thread. SIGTERM/SIGINT:
stop admitting (503), let requests in flight finish for up to `--shutdown-timeout` s, abort the
rest, stop the engine thread, exit 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from metainfer.generate_cli import add_engine_args, engine_kwargs
from metainfer.settings import settings

log = logging.getLogger("metainfer.server")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible server (/v1/completions, /v1/chat/completions, ...)",
    )
    p.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="as in `vllm serve MODEL` (= --model)"
    )
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) the API accepts; the first is reported (default: --model, or 'default')",
    )
    srv.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1/* (default: the environment's METAINFER_API_KEY, "
        "else no key)",
    )
    srv.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="auto: sampling defaults from the model's generation_config.json; vllm: built-in "
        "defaults; or a folder holding a generation_config.json",
    )
    srv.add_argument("--max-logprobs", type=int, default=20, metavar="N", help="most logprobs per request")
    srv.add_argument(
        "--reasoning-parser",
        default="qwen3",
        choices=["qwen3", "none"],
        help="qwen3: chat replies give the <think> part as `reasoning` (and `reasoning_content`); "
        "none: it stays in the content",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds requests in flight may take to finish on SIGTERM before they are aborted",
    )
    add_engine_args(p)
    from metainfer.deploy.cli import add_replica_args  # flags only: Ray is imported by --replicas N alone

    add_replica_args(p)
    http = p.add_argument_group("HTTP server internals (uvicorn)")
    http.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    http.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per request")
    # uvicorn's HTTP parser and event loop (auto: httptools / uvloop when installed)
    for name, choices, what in (
        ("http", ["auto", "h11", "httptools"], "HTTP parser (auto: httptools when installed)"),
        ("loop", ["auto", "asyncio", "uvloop"], "event loop (auto: uvloop when installed)"),
    ):
        http.add_argument(f"--uvicorn-{name}", default="auto", choices=choices, help=what)
    p.set_defaults(func=run)


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    return [args.model or "default"]


def make_server(
    app: Any, engine: Any, host: str, port: int, shutdown_timeout: float, **uvicorn_kwargs: Any
) -> Any:
    """A uvicorn server whose first SIGTERM/SIGINT drains the engine before uvicorn shuts down."""
    import asyncio

    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            self._loop: asyncio.AbstractEventLoop | None = None
            self._draining = False
            self._drain_task: asyncio.Task[None] | None = None

        async def serve(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:  # no re-raise of the signal after serve()
            if self._draining or self._loop is None:
                self.force_exit = self._draining
                self.should_exit = True
                return
            self._draining = True
            self._loop.call_soon_threadsafe(self._begin_drain)

        def _begin_drain(self) -> None:
            self._drain_task = asyncio.ensure_future(self._drain())

        async def _drain(self) -> None:
            log.info(
                "shutting down: no new requests; waiting up to %.0f s for %d in flight",
                shutdown_timeout,
                engine.num_groups,
            )
            try:
                clean = await engine.drain(shutdown_timeout)
                log.info("requests in flight %s", "finished" if clean else "aborted after the grace period")
            finally:
                self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=5, **uvicorn_kwargs)
    return DrainingServer(config)


def _engine_thread_only(ecfg) -> int | None:
    """On the CPU: build the engine with one torch thread and return the count for the engine
    thread (one OpenMP team in the process; `AsyncEngine` says why). None on CUDA."""
    import torch

    from metainfer.engine.runner import resolve_device

    if resolve_device(ecfg.device).type != "cpu":
        return None
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    return n


def run(args: argparse.Namespace) -> int:
    from metainfer.config import EngineConfig
    from metainfer.engine.engine import LLMEngine
    from metainfer.server.api import build_app, make_context
    from metainfer.server.serving import generation_dir

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if args.model_tag:
        args.model = args.model_tag
    from metainfer.deploy.cli import run_replicas, wants_replicas

    if wants_replicas(args):  # N engines on Ray Serve behind one endpoint
        return run_replicas(args)
    try:
        ecfg = EngineConfig(model=args.model, **engine_kwargs(args))
        cpu_threads = _engine_thread_only(ecfg)
        engine = LLMEngine(ecfg)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gen_dir = generation_dir(args.generation_config, engine.source.config_path.parent)
    ctx = make_context(
        engine, served_names(args), gen_dir, args.max_logprobs, cpu_threads, args.reasoning_parser
    )
    api_key = args.api_key if args.api_key is not None else settings().api_key
    app = build_app(ctx, api_key=api_key, shutdown_timeout=args.shutdown_timeout)
    log.info(
        "serving %s as %s on http://%s:%d (max_model_len %d, defaults %s, warmup %.1f s)",
        engine.source.label,
        ctx.served_model_names,
        args.host,
        args.port,
        ctx.max_model_len,
        ctx.defaults or "built-in",
        engine.runner.warmup_s,
    )
    server = make_server(
        app,
        ctx.engine,
        args.host,
        args.port,
        args.shutdown_timeout,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        http=args.uvicorn_http,
        loop=args.uvicorn_loop,
    )
    server.run()
    if ctx.engine.alive:
        ctx.engine.stop()
    return 0 if server.started else 1
