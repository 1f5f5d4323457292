"""The engine as Ray Serve replicas behind one OpenAI-compatible ingress.

    serve run metainfer.deploy.ray_serve:app                         # `metainfer serve`'s defaults
    serve run metainfer.deploy.ray_serve:build replicas=4 model=dummy:CFG dtype=fp8 routing=prefix
    metainfer serve --replicas 4 ...                                # the same, from the CLI

Two deployments:
- `EngineReplica` (one per GPU, or `replica_cpus` CPUs): one `LLMEngine` served by the very app
  `metainfer.server.api.build_app` builds (routes, errors, API key, metrics; `replica_app.llm_app`),
  run in-process by `AppRunner`; its `forward` streams a response back as a `ResponseHead` then body
  chunks, tagged with the header `x-metainfer-replica: <replica id>`.
- `OpenAIIngress`: takes every HTTP request, picks a replica through the engine deployment's request
  router and relays the response. It owns the failure answers: 429 + `Retry-After` when every
  replica is full and this ingress's queue too (Ray's `BackPressureError`), 503 JSON when the
  replica dies before answering, and an SSE error event (code 503) then `data: [DONE]` when it dies
  mid-stream. Only that replica's requests fail; Ray Serve replaces it.

Routers (run in each ingress, one per handle):
- `LeastOutstandingRouter` (default): every live replica is a candidate; the one with the fewest
  requests in flight (queue lengths cached from replies and probes) that has room gets the request,
  the oldest waiting request first. (Ray's default power-of-two router compares only two random
  replicas.)
- `PrefixAffinityRouter`: a request with a conversation key (`routing.route_key`) goes to the
  key's rendezvous-preferred replica, which holds its KV blocks and DeltaNet snapshots; when that
  replica is full, to the least-loaded one with room. No key: least-loaded.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import Response

from metainfer.deploy.asgi import AppRunner, ForwardedRequest, ResponseHead
from metainfer.deploy.replica_app import load_factory
from metainfer.deploy.routing import preferred, route_key
from metainfer.deploy.spec import DeploySpec

REPLICA_HEADER = b"x-metainfer-replica"
APP_NAME = "metainfer"
_HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te", b"trailer"}
_REPLICA_GONE = (RayActorError, ReplicaUnavailableError)


# ---- routing ---------------------------------------------------------------------------------------


def _shuffled(replicas: list[RunningReplica]) -> list[RunningReplica]:
    out = list(replicas)
    random.shuffle(out)  # equal queue lengths: a random one, not always the first
    return out


class LeastOutstandingRouter(FIFOMixin, RequestRouter):
    """One rank of every replica: the least-loaded one with room wins (see the module doc)."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: back off, then retry
        return [_shuffled(candidate_replicas)] if candidate_replicas else []


class PrefixAffinityRouter(RequestRouter):
    """Rank 1: the request key's preferred replica; rank 2: every replica (least-loaded). Requests are
    matched to replicas by id, not FIFO, so a replica chosen for one key never serves another's turn."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ranks = [_shuffled(candidate_replicas)]
        key = pending_request.kwargs.get("route_key") if pending_request is not None else None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        if key:
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            ranks.insert(0, [by_id[preferred(key, list(by_id))]])
        return ranks


ROUTERS = {"least-loaded": LeastOutstandingRouter, "prefix": PrefixAffinityRouter}


# ---- deployments -----------------------------------------------------------------------------------


class EngineReplica:
    """One replica of the app `spec.app_factory` builds (default: an engine and its `build_app`);
    `forward` answers one HTTP request."""

    async def __init__(self, spec: DeploySpec) -> None:
        built = load_factory(spec.app_factory)(spec, spec.replica_cpus)
        self.alive = built.alive
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.runner = AppRunner(
            built.app, [(REPLICA_HEADER, self.replica_id.encode())], spec.stream_interval_ms / 1000
        )
        await self.runner.start()

    async def forward(self, req: ForwardedRequest, route_key: str | None = None) -> AsyncIterator[Any]:
        """`ResponseHead`, then body chunks. `route_key` is read by the router only."""
        async for item in self.runner.forward(req):
            yield item

    def check_health(self) -> None:
        """Ray Serve replaces a replica whose engine has stopped."""
        if not self.alive():
            raise RuntimeError("the engine has stopped")

    async def __del__(self) -> None:
        await self.runner.stop()


def error_response(message: str, status: int, headers: dict[str, str] | None = None) -> Response:
    from metainfer.server.protocol import error_body

    body = json.dumps(error_body(message, status), ensure_ascii=True).encode()
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _gone_message(e: BaseException) -> str:
    return f"the replica serving this request failed ({type(e).__name__}); retry the request"


class RelayResponse(Response):
    """Sends a replica's response as it arrives. A replica lost mid-stream ends an SSE stream with an
    error event and `data: [DONE]`; any other body is cut off (its declared length is then unmet)."""

    def __init__(self, head: ResponseHead, gen: Any) -> None:
        self.status_code = head.status
        self.head = head
        self.gen = gen
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.head.status, "headers": self.head.headers})
        sse = (self.head.header(b"content-type") or b"").startswith(b"text/event-stream")
        finished = False
        try:
            async for chunk in self.gen:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finished = True
        except (RayError, ReplicaUnavailableError) as e:
            if not sse:
                raise
            from metainfer.server.protocol import error_body

            status = 503 if isinstance(e, _REPLICA_GONE) else 500
            event = json.dumps(error_body(_gone_message(e), status), ensure_ascii=True)
            await send({"type": "http.response.body", "body": f"data: {event}\n\ndata: [DONE]\n\n".encode()})
            return
        finally:
            if not finished:
                self.gen.cancel()  # the replica's handler sees a disconnect and aborts its requests
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class OpenAIIngress:
    """Every HTTP request: read it, route it to an engine replica, relay the answer."""

    def __init__(self, engine: Any, spec: DeploySpec) -> None:
        self.engine = engine.options(stream=True, method_name="forward")
        self.spec = spec

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        scope = request.scope
        fwd = ForwardedRequest(
            method=request.method,
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=[(k, v) for k, v in scope["headers"] if k not in _HOP_BY_HOP],
            body=body,
            client=tuple(scope["client"]) if scope.get("client") else None,
        )
        key = route_key(fwd.path, body, self.spec.prefix_chars) if self.spec.routing == "prefix" else None
        gen = self.engine.remote(fwd, route_key=key)
        try:
            head = await gen.__anext__()
        except BackPressureError:
            retry = str(math.ceil(self.spec.retry_after_s))  # whole seconds, as Retry-After takes
            return error_response(
                "every replica is busy and the queue is full; retry later", 429, {"Retry-After": retry}
            )
        except _REPLICA_GONE as e:
            return error_response(_gone_message(e), 503)
        except DeploymentUnavailableError:
            return error_response("no engine replica is available", 503)
        except StopAsyncIteration:
            return error_response("the replica sent no response", 502)
        except BaseException:
            gen.cancel()
            raise
        return RelayResponse(head, gen)


# ---- the application -------------------------------------------------------------------------------


def application(spec: DeploySpec) -> Any:
    """The Ray Serve application: `OpenAIIngress` over `EngineReplica`s, as `spec` says."""
    actor = {"num_cpus": spec.replica_cpus, **({"num_gpus": 1} if spec.use_gpu else {})}
    scale: dict[str, Any] = (
        {"autoscaling_config": spec.autoscaling} if spec.autoscaling else {"num_replicas": spec.replicas}
    )
    engine = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        max_ongoing_requests=spec.max_ongoing_requests,
        max_queued_requests=spec.max_queued_requests,
        ray_actor_options=actor,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[spec.routing]),
        graceful_shutdown_timeout_s=spec.shutdown_timeout + 5,
        health_check_period_s=5,
        max_constructor_retry_count=3,
        **scale,
    ).bind(spec)
    return serve.deployment(
        OpenAIIngress,
        name="OpenAIIngress",
        num_replicas=spec.ingress_replicas,
        max_ongoing_requests=1_000_000,  # it only relays: the engine deployment holds the limits
        ray_actor_options={"num_cpus": spec.ingress_cpus},
    ).bind(engine, spec)


def uses_gpu(device: str) -> bool:
    """Whether replicas take a GPU each: `device` cuda*, or auto with GPUs in the Ray cluster (or,
    before `ray.init`, on this host)."""
    if device == "cpu":
        return False
    if device != "auto":
        return True
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def build(args: dict[str, str]) -> Any:
    """Application builder for `serve run metainfer.deploy.ray_serve:build key=value ...`: each key is a
    `metainfer serve` flag (`max_num_seqs=32` is `--max-num-seqs 32`; a value of `true` is a bare flag)."""
    from metainfer.cli import build_parser
    from metainfer.deploy.spec import spec_from_args

    argv = ["serve"]
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if str(v).lower() == "true" else [flag, str(v)]
    ns = build_parser("serve").parse_args(argv)
    if ns.model_tag:
        ns.model = ns.model_tag
    return application(spec_from_args(ns, uses_gpu(ns.device)))


def __getattr__(name: str) -> Any:
    if name == "app":  # built on first access: `serve run metainfer.deploy.ray_serve:app`
        return build({})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it with `serve run metainfer.deploy.ray_serve:app` or `metainfer serve --replicas N`")
