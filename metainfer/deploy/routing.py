"""Prefix-aware routing, the parts without Ray: a request's conversation key and the consistent
(rendezvous) order of replicas for a key.

Key of a request (None: no preference, the request goes to the least-loaded replica):
- /v1/chat/completions: the messages up to and including the first user message, each one's role and
  first `prefix_chars` characters of text. A later turn of the same conversation repeats those
  messages, so it gets the same key; conversations that share only a system prompt do not.
- /v1/completions: the prompt's first `prefix_chars` characters (a token-id prompt: its first
  `prefix_chars` ids). A multi-turn prompt that grows by appending keeps its key once its first
  turn is at least that long.
- anything else, or a body that is not the JSON object expected: None (the replica answers the 4xx).

Replica order for a key: highest-random-weight hashing, `blake2b(key, replica id)` per replica,
highest first. Every ingress computes the same order from the same replica set, and a replica that
leaves or joins moves only the keys it wins or loses.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content-part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = (p.get("text") for p in content if isinstance(p, dict))
        return "".join(t for t in parts if isinstance(t, str))
    return ""


def route_key(path: str, body: bytes, prefix_chars: int) -> str | None:
    """The conversation key of a request to `path` with JSON `body` (see the module docstring)."""
    if path not in ("/v1/chat/completions", "/v1/completions"):
        return None
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(req, dict):
        return None
    if path == "/v1/chat/completions":
        messages = req.get("messages")
        if not isinstance(messages, list):
            return None
        head: list[str] = []
        for m in messages:
            if not isinstance(m, dict):
                return None
            role = m.get("role")
            head.append(f"{role}\x00{_text(m.get('content'))[:prefix_chars]}")
            if role == "user":
                break
        return "chat\x01" + "\x01".join(head) if head else None
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:  # a batch of one
        prompt = prompt[0]
    if isinstance(prompt, str):
        return "text\x01" + prompt[:prefix_chars]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return "ids\x01" + ",".join(map(str, prompt[:prefix_chars]))
    return None


def _weight(key: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest()


def rendezvous_order(key: str, replicas: Iterable[str]) -> list[str]:
    """`replicas` (ids) from the most to the least preferred for `key`."""
    return sorted(replicas, key=lambda r: _weight(key, r), reverse=True)


def preferred(key: str, replicas: Sequence[str]) -> str | None:
    """The replica `key` goes to while that replica has room (None: no replicas)."""
    return max(replicas, key=lambda r: _weight(key, r), default=None)
