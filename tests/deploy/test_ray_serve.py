"""Two CPU replicas of the embedded default model on a local Ray cluster, behind the ingress: the
official `openai` client, load spread, 4xx, a replica killed under 32 streams, 429 when full, prefix
routing. One cluster and one application for the module; tiny outputs."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from ray import serve  # noqa: E402

from metainfer.deploy import ray_serve  # noqa: E402
from metainfer.deploy.spec import DeploySpec  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

MODEL, KEY = "qwen-test", "test-key"
PER_REPLICA = 20  # max_ongoing_requests: the kill test's 32 streams and 4 plain requests fit
QUEUED = 32  # requests being routed count as queued: room for a burst


def _spec(**over) -> DeploySpec:
    base = dict(
        engine={"model": "", "device": "cpu", "max_model_len": 512, "max_num_seqs": PER_REPLICA,
                "warmup": False},
        served_model_names=(MODEL,), api_key=KEY, replicas=2, use_gpu=False, replica_cpus=0.5,
        ingress_cpus=0.1, max_ongoing_requests=PER_REPLICA, max_queued_requests=QUEUED, retry_after_s=1.0,
        shutdown_timeout=2.0,
    )
    return DeploySpec(**{**base, **over})


def _deploy(spec: DeploySpec) -> None:
    serve.run(ray_serve.application(spec), name=ray_serve.APP_NAME, route_prefix="/")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    _deploy(_spec())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _replica(raw) -> str:
    return raw.headers["x-metainfer-replica"]


def test_openai_client_completions_chat_and_streams(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="def add(a, b):", max_tokens=4)
    c = raw.parse()
    assert _replica(raw) and c.choices[0].finish_reason in ("length", "stop")
    assert c.usage.completion_tokens >= 1
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens >= 1
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt="import os\n", max_tokens=4, stream=True) if ch.choices)
    assert text
    assert [m.id for m in client.models.list()] == [MODEL]


def test_load_spreads_across_both_replicas(base_url: str, client: openai.OpenAI) -> None:
    seen: list[str] = []

    def one(i: int) -> None:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"x = {i}", max_tokens=4)
        seen.append(_replica(raw))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = Counter(seen)
    assert len(seen) == 12 and len(counts) == 2 and min(counts.values()) >= 3, counts
    served = {r: _counter(text, 'outcome="length"') for r, text in _replica_metrics(base_url).items()}
    assert set(served) == set(counts) and min(served.values()) >= 3, served  # each replica's own count


def _replica_metrics(base_url: str, tries: int = 60) -> dict[str, str]:
    """Each replica's /metrics text (a request reaches one replica; its header says which)."""
    out: dict[str, str] = {}
    for _ in range(tries):
        r = httpx.get(base_url + "/metrics", timeout=60)
        out[r.headers["x-metainfer-replica"]] = r.text
        if len(out) == 2:
            break
    return out


def _counter(text: str, label: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("metainfer:requests_total{") and label in line)


def test_a_client_that_disconnects_aborts_its_request_on_the_replica(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        home = r.headers["x-metainfer-replica"]
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 60
    while _counter(_replica_metrics(base_url)[home], 'outcome="abort"') < 1:
        assert time.monotonic() < deadline, "the replica never aborted the request"
        time.sleep(0.5)


def test_bad_input_is_still_4xx(base_url: str, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(base_url + "/v1/chat/completions", content=b"{not json", headers=auth, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    r = httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=60)
    assert r.status_code == 401
    assert httpx.get(base_url + "/health", timeout=60).status_code == 200


class Stream(threading.Thread):
    """One streamed completion read event by event: its replica, chunks, and how it ended."""

    def __init__(self, base_url: str, max_tokens: int, started: threading.Barrier | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.started = base_url, max_tokens, started
        self.replica = self.status = self.end = None
        self.chunks = 0
        self.first = threading.Event()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "def main():", "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=300,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                self.status, self.replica = r.status_code, r.headers.get("x-metainfer-replica")
                self.retry_after = r.headers.get("retry-after")
                if r.status_code != 200:
                    r.read()
                    self.end = r.json()["error"]["code"]
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.end = self.end or "done"
                        break
                    if '"error"' in line[:20]:
                        self.end = "error"
                        continue
                    self.chunks += 1
                    self.first.set()
        finally:
            self.first.set()


def _replica_actor(unique_id: str):
    from ray.serve._private.common import DeploymentID, ReplicaID

    rid = ReplicaID(unique_id, DeploymentID(name="EngineReplica", app_name=ray_serve.APP_NAME))
    return ray.get_actor(rid.to_full_id_str(), namespace="serve")


def _running_replicas() -> int:
    app = serve.status().applications[ray_serve.APP_NAME]
    return app.deployments["EngineReplica"].replica_states.get("RUNNING", 0)


@pytest.mark.slow
def test_a_replica_killed_under_32_streams_fails_only_its_own(base_url: str, client: openai.OpenAI) -> None:
    plain: list[httpx.Response] = []

    def post() -> None:
        body = {"model": MODEL, "prompt": "class A:", "max_tokens": 200, "ignore_eos": True}
        plain.append(httpx.post(base_url + "/v1/completions", json=body, timeout=300,
                                headers={"Authorization": f"Bearer {KEY}"}))

    posts = [threading.Thread(target=post, daemon=True) for _ in range(4)]
    for t in posts:
        t.start()
    streams = [Stream(base_url, max_tokens=200) for _ in range(32)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(120)
    by_replica = Counter(s.replica for s in streams)
    assert len(by_replica) == 2 and all(s.status == 200 and s.chunks for s in streams), by_replica
    victim = next(iter(by_replica))
    ray.kill(_replica_actor(victim), no_restart=True)
    for s in streams:
        s.join(240)
    lost = [s for s in streams if s.replica == victim]
    kept = [s for s in streams if s.replica != victim]
    assert all(s.end == "error" and s.chunks < 200 for s in lost), [(s.end, s.chunks) for s in lost]
    assert all(s.end == "done" and s.chunks == 200 for s in kept), [(s.end, s.chunks) for s in kept]
    for t in posts:  # a plain request is answered in full by the survivor, or is a 503 JSON error
        t.join(240)
    assert len(plain) == 4
    for r in plain:
        if r.status_code == 200:
            assert _replica(r) != victim and r.json()["usage"]["completion_tokens"] == 200
        else:
            assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError", r.text
    # new requests go to the survivor at once, and Ray brings the replica count back
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2)
    assert raw.parse().choices and _replica(raw) != victim
    deadline = time.monotonic() + 180
    while _running_replicas() < 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert _running_replicas() == 2
    seen = {_replica(client.completions.with_raw_response.create(model=MODEL, prompt=f"{i}", max_tokens=2))
            for i in range(12)}
    assert victim not in seen and seen


@pytest.fixture(scope="module")
def small_prefix_app(base_url: str) -> str:
    """The module's last tests: the app redeployed with prefix routing and room for 2 + 2 requests a
    replica (queued: 2 per ingress)."""
    _deploy(_spec(routing="prefix", max_ongoing_requests=SMALL, max_queued_requests=SMALL))
    return base_url


SMALL = 2


@pytest.mark.slow
def test_every_replica_full_is_429_with_retry_after(small_prefix_app: str) -> None:
    n = 2 * SMALL + SMALL + 8
    streams = [Stream(small_prefix_app, max_tokens=120) for _ in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        s.join(300)
    rejected = [s for s in streams if s.status == 429]
    served = [s for s in streams if s.status == 200]
    assert rejected and all(s.retry_after == "1" and s.end == 429 for s in rejected)
    assert len(served) + len(rejected) == n and all(s.end == "done" and s.chunks == 120 for s in served)


@pytest.mark.slow
def test_prefix_routing_keeps_conversations_home(small_prefix_app: str, client: openai.OpenAI) -> None:
    homes = {}
    for conv in range(10):
        messages = [{"role": "user", "content": f"conversation {conv}: say something"}]
        seen = set()
        for turn in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=3,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            seen.add(_replica(raw))
            messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content or ""},
                         {"role": "user", "content": f"turn {turn}"}]
        assert len(seen) == 1, (conv, seen)
        homes[conv] = seen.pop()
    assert len(set(homes.values())) == 2, homes  # conversations still spread
