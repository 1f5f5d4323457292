from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_openai import Behaviour, FakeServer  # noqa: E402


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[FakeServer]:
    """A fake OpenAI server in a background thread; parametrise it indirectly with a `Behaviour`."""
    b = getattr(request, "param", None) or Behaviour()
    with FakeServer(b) as s:
        yield s
