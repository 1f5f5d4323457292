"""`OpenAIIngress` without a cluster: a stand-in engine handle stands for the replicas, so each failure
Ray reports is answered as the contract says (429 + Retry-After, 503 JSON, SSE error event)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray")

from ray.exceptions import ActorDiedError  # noqa: E402
from ray.serve.exceptions import BackPressureError  # noqa: E402
from starlette.requests import Request  # noqa: E402

from metainfer.deploy.asgi import ResponseHead  # noqa: E402
from metainfer.deploy.ray_serve import OpenAIIngress  # noqa: E402
from metainfer.deploy.spec import DeploySpec  # noqa: E402

SSE_HEAD = ResponseHead(200, [(b"content-type", b"text/event-stream; charset=utf-8")])


class FakeStream:
    """What `handle.options(stream=True).remote(...)` returns: items, then `fail` (if any)."""

    def __init__(self, items: list, fail: BaseException | None) -> None:
        self.items, self.fail, self.cancelled = list(items), fail, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.fail is not None:
            raise self.fail
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    def __init__(self, items: list, fail: BaseException | None = None) -> None:
        self.items, self.fail, self.calls, self.streams = items, fail, [], []

    def options(self, **_: object) -> FakeHandle:
        return self

    def remote(self, req, route_key=None) -> FakeStream:
        self.calls.append((req, route_key))
        self.streams.append(FakeStream(self.items, self.fail))
        return self.streams[-1]


def _serve(handle: FakeHandle, body: dict, path: str = "/v1/chat/completions", **spec) -> tuple:
    async def main():
        raw = json.dumps(body).encode()
        scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"connection", b"keep-alive")],
                 "client": ("127.0.0.1", 5), "server": ("127.0.0.1", 8000), "scheme": "http"}
        sent = []

        async def receive():
            return {"type": "http.request", "body": raw, "more_body": False}

        async def send(msg):
            sent.append(msg)

        ingress = OpenAIIngress(handle, DeploySpec(**spec))
        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)
        return sent

    sent = asyncio.run(main())
    start = sent[0]
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    assert sent[-1].get("more_body", False) is False
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_relays_head_and_body_and_drops_hop_by_hop_headers() -> None:
    head = ResponseHead(200, [(b"content-type", b"application/json"), (b"x-metainfer-replica", b"r")])
    h = FakeHandle([head, b'{"a":', b"1}"])
    status, headers, body = _serve(h, CHAT)
    assert status == 200 and headers["x-metainfer-replica"] == "r" and json.loads(body) == {"a": 1}
    req, key = h.calls[0]
    assert key is None and (b"connection", b"keep-alive") not in req.headers and json.loads(req.body) == CHAT


def test_prefix_routing_passes_the_conversation_key() -> None:
    h = FakeHandle([ResponseHead(200, []), b"{}"])
    _serve(h, CHAT, routing="prefix")
    assert h.calls[0][1] and h.calls[0][1].startswith("chat")


def test_every_replica_full_is_429_with_retry_after() -> None:
    status, headers, body = _serve(FakeHandle([], BackPressureError(8, 8)), CHAT, retry_after_s=2.0)
    assert status == 429 and headers["retry-after"] == "2"
    assert json.loads(body)["error"]["code"] == 429


def test_replica_lost_before_answering_is_503_json() -> None:
    status, _, body = _serve(FakeHandle([], ActorDiedError()), CHAT)
    err = json.loads(body)["error"]
    assert status == 503 and err["type"] == "ServiceUnavailableError" and "retry" in err["message"]


def test_replica_lost_mid_stream_ends_the_stream_with_an_error_event() -> None:
    h = FakeHandle([SSE_HEAD, b'data: {"x": 1}\n\n'], ActorDiedError())
    status, _, body = _serve(h, CHAT)
    events = body.decode().split("\n\n")
    assert status == 200 and events[0] == 'data: {"x": 1}' and events[-2] == "data: [DONE]"
    assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == 503
    assert h.streams[0].cancelled  # the replica-side stream is released


def test_a_finished_stream_is_not_cancelled() -> None:
    h = FakeHandle([SSE_HEAD, b"data: [DONE]\n\n"])
    assert _serve(h, CHAT)[2] == b"data: [DONE]\n\n" and not h.streams[0].cancelled


def test_flags_become_the_deployments_bounds_router_and_resources() -> None:
    from metainfer.deploy.ray_serve import PrefixAffinityRouter, build

    app = build({"replicas": "2", "min_replicas": "1", "max_replicas": "4", "target_ongoing_requests": "8",
                 "routing": "prefix", "device": "cpu", "replica_cpus": "0.5", "max_num_seqs": "16"})
    ingress = app._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    cfg = engine._deployment_config
    auto = cfg.autoscaling_config
    bounds = (auto.min_replicas, auto.initial_replicas, auto.max_replicas, auto.target_ongoing_requests)
    assert bounds == (1, 2, 4, 8)
    assert cfg.max_ongoing_requests == 16 and cfg.max_queued_requests == 4 * 16
    assert cfg.request_router_config.request_router_class.endswith(PrefixAffinityRouter.__name__)
    assert engine.ray_actor_options == {"num_cpus": 0.5}  # no GPU asked on a CPU deployment
    assert ingress._deployment_config.num_replicas == 2
