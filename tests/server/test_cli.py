"""`metainfer serve` as a subprocess: flags, API key on /v1/*, and graceful SIGTERM (503 for new
requests, the request in flight finishes, exit code 0)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from metainfer.cli import build_parser
from metainfer.server.protocol import CompletionRequest
from metainfer.server.serving import ServingContext, generation_dir, load_generation_defaults
from tests.server.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-test-key"


def test_serve_flags_follow_vllm_names() -> None:
    args = build_parser("serve").parse_args(
        [
            "serve",
            "--model",
            "dummy:/x.json",
            "--host",
            "0.0.0.0",
            "--port",
            "9001",
            "--served-model-name",
            "a",
            "b",
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "4",
            "--api-key",
            "k",
            "--dtype",
            "bfloat16",
            "--device",
            "cpu",
        ]
    )
    assert (args.model, args.host, args.port, args.served_model_name) == (
        "dummy:/x.json",
        "0.0.0.0",
        9001,
        ["a", "b"],
    )
    assert (args.max_model_len, args.max_num_seqs, args.api_key, args.dtype) == (1024, 4, "k", "bfloat16")
    positional = build_parser("serve").parse_args(["serve", "/models/qwen"])
    assert (
        positional.model_tag == "/models/qwen" and positional.host == "127.0.0.1" and positional.port == 8000
    )


def test_generation_config_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_k": 20, "top_p": 0.95, "do_sample": True})
    )
    assert generation_dir("vllm", tmp_path) is None and generation_dir("auto", tmp_path) == tmp_path
    defaults = load_generation_defaults(generation_dir("auto", tmp_path))
    assert defaults == {"temperature": 0.7, "top_k": 20, "top_p": 0.95}
    unused: Any = None
    ctx = ServingContext(unused, unused, ["m"], 64, unused, defaults=defaults)
    (p,) = ctx.sampling_params(CompletionRequest(prompt="x", top_k=5), 4, None)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens) == (0.7, 5, 0.95, 0.0, 4)
    a, b = ctx.sampling_params(CompletionRequest(prompt="x", n=2, seed=10), 4, None)
    assert (a.seed, b.seed) == (10, 11)


class Proc:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "server.log"
        cmd = [
            sys.executable,
            "-m",
            "metainfer.cli",
            "serve",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "8",
            "--api-key",
            KEY,
            "--served-model-name",
            "m1",
            "--shutdown-timeout",
            "600",  # the drain never cuts the test's stream short, however loaded the machine
            "--uvicorn-log-level",
            "warning",
        ]
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
            "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
            "OMP_NUM_THREADS": "1",  # small ops: a second thread on shared cores only waits (conftest.py)
        }
        self.p = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT
        )

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"server exited {self.p.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy:\n{self.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    p = Proc(tmp_path_factory.mktemp("serve"))
    try:
        p.wait_healthy()
        yield p
    finally:
        if p.p.poll() is None:
            p.p.kill()
            p.p.wait(10)


@pytest.mark.timeout(300)
def test_api_key(proc: Proc) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(proc.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    r = httpx.post(proc.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 401
    assert httpx.get(proc.url + "/health").status_code == 200
    assert httpx.get(proc.url + "/metrics").status_code == 200
    assert httpx.post(proc.url + "/tokenize", json={"prompt": "hi"}).status_code == 200
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["m1"]
    r = client.completions.create(model="m1", prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=proc.url + "/v1", api_key="nope", max_retries=0).models.list()


@pytest.mark.timeout(300)
def test_sigterm_drains_then_exits_0(proc: Proc) -> None:
    """The behaviour, not a race: the stream in flight at SIGTERM ends complete, new work gets 503, exit 0."""
    max_tokens = 96  # one thread: a few seconds, still streaming long after the SIGTERM and the 503
    body = {
        "model": "m1",
        "prompt": "hi",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = threading.Event()
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream(
            "POST",
            proc.url + "/v1/completions",
            json=body,
            timeout=120,
            headers={"Authorization": f"Bearer {KEY}"},
        ) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    proc.p.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    r = httpx.post(
        proc.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    assert httpx.get(proc.url + "/health").status_code == 503
    t.join(300)
    assert not t.is_alive(), "the stream in flight ends"
    assert lines[-1] == "data: [DONE]"
    assert f'"completion_tokens":{max_tokens}' in lines[-2], "the request in flight finishes"
    assert proc.p.wait(120) == 0
    log = proc.log.read_text()
    assert "Traceback" not in log, log
