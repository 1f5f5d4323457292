"""Prefix-aware routing without Ray: conversation keys and the rendezvous order of replicas; the
deployment spec's validation; `metainfer serve --replicas` without Ray."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter

import pytest

from metainfer.deploy.routing import preferred, rendezvous_order, route_key
from metainfer.deploy.spec import DeploySpec

CHAT, COMP = "/v1/chat/completions", "/v1/completions"


def _chat(*messages: tuple[str, str]) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}).encode()


def test_later_turns_of_a_conversation_keep_its_key() -> None:
    turn1 = _chat(("system", "You help."), ("user", "What is 2+2?"))
    turn2 = _chat(("system", "You help."), ("user", "What is 2+2?"), ("assistant", "4"), ("user", "And 3+3?"))
    assert route_key(CHAT, turn1, 512) == route_key(CHAT, turn2, 512) is not None
    other = _chat(("system", "You help."), ("user", "Name a prime."))
    assert route_key(CHAT, other, 512) != route_key(CHAT, turn1, 512)  # a shared system prompt alone
    content = [{"type": "text", "text": "What is 2+2?"}]
    parts = json.dumps({"messages": [{"role": "user", "content": content}]})
    assert route_key(CHAT, parts.encode(), 512) == route_key(CHAT, _chat(("user", "What is 2+2?")), 512)


def test_completion_keys_are_the_prompt_head() -> None:
    long = "x" * 600
    k = route_key(COMP, json.dumps({"prompt": long + " turn 1"}).encode(), 512)
    assert k == route_key(COMP, json.dumps({"prompt": [long + " turn 1 reply turn 2"]}).encode(), 512)
    ids = route_key(COMP, json.dumps({"prompt": list(range(600))}).encode(), 512)
    assert ids == route_key(COMP, json.dumps({"prompt": list(range(700))}).encode(), 512) != k


@pytest.mark.parametrize(
    "path, body",
    [("/v1/models", b""), (COMP, b"not json"), (COMP, b"[1, 2]"), (COMP, b'{"prompt": 3}'),
     (CHAT, b'{"messages": "hi"}'), (CHAT, b'{"messages": [3]}'), (COMP, b'{"prompt": ["a", "b"]}')],
)
def test_no_key_for_what_the_replica_rejects_or_cannot_key(path: str, body: bytes) -> None:
    assert route_key(path, body, 512) is None


def test_rendezvous_is_consistent_spread_and_stable() -> None:
    replicas = [f"r{i}" for i in range(4)]
    keys = [f"conversation {i}" for i in range(2000)]
    first = {k: preferred(k, replicas) for k in keys}
    assert all(rendezvous_order(k, reversed(replicas))[0] == first[k] for k in keys[:50])
    counts = Counter(first.values())
    assert set(counts) == set(replicas) and min(counts.values()) > 350  # ~500 each
    without = [r for r in replicas if r != "r2"]
    moved = [k for k in keys if preferred(k, without) != first[k]]
    assert moved and all(first[k] == "r2" for k in moved)  # only r2's keys move
    assert preferred("k", []) is None


def test_spec_validation_and_autoscaling() -> None:
    s = DeploySpec(replicas=2, max_replicas=6, min_replicas=1, max_ongoing_requests=64)
    assert s.autoscaling == {"min_replicas": 1, "max_replicas": 6, "initial_replicas": 2,
                             "target_ongoing_requests": 32.0}
    assert DeploySpec(replicas=3).autoscaling is None
    for bad, says in [({"replicas": 0}, "--replicas"), ({"min_replicas": 2}, "needs --max-replicas"),
                      ({"max_replicas": 2, "min_replicas": 3}, "--max-replicas"),
                      ({"routing": "rr"}, "--routing"),
                      ({"max_queued_requests": 0}, "--max-queued-requests"),
                      ({"target_ongoing_requests": 0.0, "max_replicas": 2}, "--target-ongoing-requests")]:
        with pytest.raises(ValueError, match=says):
            DeploySpec(**bad)


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")
def test_replicas_without_ray_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    from metainfer.cli import main

    assert main(["serve", "--replicas", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "pip install -e '.[ray]'" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, says",
    [(["--max-queued-requests", "0"], "error: --max-queued-requests"),
     (["--model", "/nonexistent/model"], "error: model directory not found"),
     (["--min-replicas", "2"], "error: --min-replicas needs --max-replicas")],
)
def test_bad_replica_flags_are_one_error_line(argv, says, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray")
    from metainfer.cli import main

    assert main(["serve", "--replicas", "2", "--device", "cpu", *argv]) == 2  # before any Ray starts
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1, err
