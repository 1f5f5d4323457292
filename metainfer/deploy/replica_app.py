"""What one replica serves: a `ReplicaApp` built from the `DeploySpec` by the factory its
`app_factory` names ("module:function"). No Ray.

`llm_app` (the default) is `metainfer serve`'s own app on one `LLMEngine`. Another service (Sammie's
`metainfer sam serve`) is replicated the same way by a factory of its own: an ASGI app whose lifespan
starts and stops its engine, and a liveness probe; `spec.engine` carries its keyword arguments.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from metainfer.deploy.spec import DeploySpec


@dataclass(frozen=True)
class ReplicaApp:
    app: Any  # ASGI; its lifespan starts the engine and, at shutdown, drains and stops it
    alive: Callable[[], bool]  # False: the replica is unhealthy and Ray Serve replaces it


def load_factory(path: str) -> Callable[[DeploySpec, float], ReplicaApp]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def llm_app(spec: DeploySpec, cpus: float) -> ReplicaApp:
    """One `LLMEngine(EngineConfig(**spec.engine))` behind `build_app` (`cpus`: the replica's CPUs)."""
    import torch

    from metainfer.config import EngineConfig
    from metainfer.engine.engine import LLMEngine
    from metainfer.engine.runner import resolve_device
    from metainfer.server.api import build_app, make_context
    from metainfer.server.serving import generation_dir

    ecfg = EngineConfig(**spec.engine)
    cpu_threads = None
    if resolve_device(ecfg.device).type == "cpu":  # torch ops on the engine thread only (see AsyncEngine)
        cpu_threads = max(1, int(cpus))
        torch.set_num_threads(1)
    engine = LLMEngine(ecfg, progress=False)
    gen_dir = generation_dir(spec.generation_config, engine.source.config_path.parent)
    names = list(spec.served_model_names)
    ctx = make_context(engine, names, gen_dir, spec.max_logprobs, cpu_threads, spec.reasoning_parser)
    app = build_app(ctx, api_key=spec.api_key, shutdown_timeout=spec.shutdown_timeout)
    return ReplicaApp(app, lambda: ctx.engine.alive)
