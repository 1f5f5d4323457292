"""`bench compare`: start each engine's OpenAI server in turn, run the same workloads, stop it.

Engines:
- `metainfer`: `python -m metainfer.cli serve --model MODEL --port P` (+ `--quantization fp8` for fp8);
- `vllm` (only when importable): `vllm serve DIR --load-format dummy --port P` on a temporary model
  directory holding the config (and tokenizer files from `--tokenizer-dir`, when given);
- any other: `--engine-cmd NAME=TEMPLATE` with `{port}`, `{model}`, `{model_dir}`, `{config}`.
Workloads (lengths from the flags):
- `c1`: one request at a time, input_len in / output_len out (single-stream decode);
- `ttft`: one request at a time, output 1 token (idle-server TTFT);
- `cN`: N concurrent requests (throughput at concurrency N).
"""

from __future__ import annotations

import asyncio
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from metainfer.bench.client import ClientConfig, served_model_name, wait_for_health
from metainfer.bench.datasets import DatasetSpec
from metainfer.bench.env import write_json
from metainfer.bench.serve import RooflineSpec, run_ok, serve_benchmark


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    max_concurrency: int
    num_prompts: int


def parse_workloads(
    spec: str, input_len: int, output_len: int, num_prompts: int | None = None
) -> list[Workload]:
    """`c1,ttft,c32` -> workloads; `num_prompts` overrides the defaults (c1: 4, ttft: 8, cN: 4N)."""
    out = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name == "ttft":
            out.append(Workload(name, input_len, 1, 1, num_prompts or 8))
        elif name.startswith("c") and name[1:].isdigit() and int(name[1:]) > 0:
            c = int(name[1:])
            out.append(Workload(name, input_len, output_len, c, num_prompts or (4 if c == 1 else 4 * c)))
        else:
            raise ValueError(f"unknown workload {name!r} (c1, ttft, cN)")
    if not out:
        raise ValueError("no workloads")
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_file(model: str) -> Path:
    p = Path(model[len("dummy:") :] if model.startswith("dummy:") else model)
    return p / "config.json" if p.is_dir() else p


def make_model_dir(config: Path, tokenizer_dir: str | None) -> Path:
    """A temporary HF-style model directory: config.json (+ generation_config.json, tokenizer files)."""
    d = Path(tempfile.mkdtemp(prefix="metainfer-bench-model-"))
    shutil.copyfile(config, d / "config.json")
    gen = config.with_name(config.name.replace(".json", ".generation_config.json"))
    if config.name != "config.json" and gen.is_file():
        shutil.copyfile(gen, d / "generation_config.json")
    elif (config.parent / "generation_config.json").is_file():
        shutil.copyfile(config.parent / "generation_config.json", d / "generation_config.json")
    if tokenizer_dir:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("vocab.json", "merges.txt")):
                shutil.copyfile(f, d / f.name)
    return d


def engine_command(
    engine: str, model: str, port: int, model_dir: Path, dtype: str, templates: dict[str, str]
) -> tuple[list[str] | None, str]:
    """(argv, "") or (None, reason the engine is skipped)."""
    if engine in templates:
        text = templates[engine].format(
            port=port, model=model, model_dir=model_dir, config=config_file(model)
        )
        return shlex.split(text), ""
    if engine == "metainfer":
        if find_spec("metainfer.server.cli") is None:
            return None, "metainfer.server.cli is not importable (server not built yet)"
        cmd = [sys.executable, "-m", "metainfer.cli", "serve", "--model", model, "--port", str(port)]
        if dtype == "fp8":
            cmd += ["--quantization", "fp8"]
        return cmd, ""
    if engine == "vllm":
        if find_spec("vllm") is None:
            return None, "vllm is not importable in this environment"
        exe = shutil.which("vllm")
        head = [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
        cmd = [
            *head,
            "serve",
            str(model_dir),
            "--load-format",
            "dummy",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--dtype",
            "bfloat16",
            "--served-model-name",
            "bench-model",
        ]
        if dtype == "fp8":
            cmd += ["--quantization", "fp8"]
        return cmd, ""
    return None, f"unknown engine {engine!r} (metainfer, vllm, or give --engine-cmd {engine}=TEMPLATE)"


class ServerProcess:
    """A server subprocess in its own process group; logs to a file; stopped with SIGTERM then SIGKILL."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 30.0) -> int | None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass(frozen=True)
class CompareConfig:
    engines: tuple[str, ...]
    model: str  # dummy:CONFIG (or a model dir)
    workloads: tuple[Workload, ...]
    out_dir: Path
    dtype: str = "bfloat16"
    dataset: str = "random"
    seed: int = 0
    warmup: int = 2
    startup_timeout_s: float = 900.0
    tokenizer_dir: str | None = None
    templates: tuple[tuple[str, str], ...] = ()  # (engine, command template)
    bandwidth: float = 4.3
    verdict: str | None = None
    baseline: str | None = None


def run_compare(
    cfg: CompareConfig, argv: list[str] | None = None, log: Any = print
) -> tuple[list[Path], bool]:
    """Runs every (engine, workload); returns (result files, all ran cleanly)."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    templates = dict(cfg.templates)
    model_dir = make_model_dir(config_file(cfg.model), cfg.tokenizer_dir)
    files: list[Path] = []
    ok = True
    try:
        for engine in cfg.engines:
            port = free_port()
            cmd, reason = engine_command(engine, cfg.model, port, model_dir, cfg.dtype, templates)
            if cmd is None:
                log(f"[compare] skipping engine {engine}: {reason}")
                continue
            log(f"[compare] starting {engine}: {shlex.join(cmd)}")
            server = ServerProcess(cmd, cfg.out_dir / f"{engine}.server.log")
            base_url = f"http://127.0.0.1:{port}"
            try:
                t0 = time.monotonic()
                if not asyncio.run(wait_for_health(base_url, cfg.startup_timeout_s, server.alive)):
                    log(f"[compare] {engine} did not become healthy; log tail:\n{server.log_tail()}")
                    ok = False
                    continue
                log(f"[compare] {engine} healthy after {time.monotonic() - t0:.1f} s")
                name = asyncio.run(served_model_name(base_url)) or "default"
                for w in cfg.workloads:
                    path, good = _run_workload(cfg, engine, w, base_url, name, cmd, argv, log)
                    files.append(path)
                    ok = ok and good
            finally:
                rc = server.stop()
                log(f"[compare] stopped {engine} (exit {rc})")
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    return files, ok and bool(files)


def _run_workload(
    cfg: CompareConfig,
    engine: str,
    w: Workload,
    base_url: str,
    model_name: str,
    server_cmd: list[str],
    argv: list[str] | None,
    log: Any,
) -> tuple[Path, bool]:
    client = ClientConfig(
        base_url=base_url,
        model=model_name,
        max_concurrency=w.max_concurrency,
        request_rate=math.inf,
        ignore_eos=True,
        seed=cfg.seed,
        warmup=cfg.warmup,
    )
    dataset = DatasetSpec.parse(
        cfg.dataset, input_len=w.input_len, output_len=w.output_len, num_prompts=w.num_prompts, seed=cfg.seed
    )
    roof = RooflineSpec(model=str(config_file(cfg.model)), dtype=cfg.dtype, bandwidth=cfg.bandwidth)
    obj, table, run = serve_benchmark(
        client,
        dataset,
        roof,
        engine=engine,
        workload=w.name,
        verdict=cfg.verdict,
        argv=argv,
        tokenizer_dir=cfg.tokenizer_dir,
    )
    obj["server_command"] = shlex.join(server_cmd)
    path = write_json(cfg.out_dir / f"{engine}-{w.name}.json", obj)
    log(f"[compare] {engine} / {w.name} -> {path}\n{table}")
    return path, run_ok(run.metrics)
