"""`DeploySpec`: everything a replicated deployment needs, validated once on the driver and shipped
(pickled) to every replica. No Ray import."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

ROUTINGS = ("least-loaded", "prefix")


@dataclass(frozen=True)
class DeploySpec:
    """One engine per replica (`engine`: `EngineConfig` keyword arguments) served by `build_app`, or
    what another `app_factory` builds from `engine` (see `replica_app`).

    Replica count: fixed at `replicas`, or autoscaled between `min_replicas` and `max_replicas`
    (starting at `replicas`, clamped) towards `target_ongoing_requests` per replica when
    `max_replicas` is set.
    Admission: a replica takes at most `max_ongoing_requests` requests at once; each ingress replica
    holds at most `max_queued_requests` requests not yet on a replica (those being routed included,
    so a burst needs room; -1: no limit) and answers 429 with `Retry-After: retry_after_s` past that.
    """

    engine: dict[str, Any] = field(default_factory=dict)
    app_factory: str = "metainfer.deploy.replica_app:llm_app"  # "module:function" building a ReplicaApp
    served_model_names: tuple[str, ...] = ("default",)
    api_key: str | None = None
    generation_config: str = "auto"  # auto | vllm | a folder holding generation_config.json
    max_logprobs: int = 20
    reasoning_parser: str = "qwen3"
    shutdown_timeout: float = 30.0

    replicas: int = 2
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # None: half of max_ongoing_requests
    routing: str = "least-loaded"
    prefix_chars: int = 512
    max_ongoing_requests: int = 64
    max_queued_requests: int = 64
    retry_after_s: float = 1.0
    use_gpu: bool = True  # one GPU per replica; False: `replica_cpus` CPUs each
    replica_cpus: float = 1.0
    ingress_replicas: int = 1
    ingress_cpus: float = 0.5
    stream_interval_ms: float = 0.0  # a replica's streamed chunks after the first: at least this far apart

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(what)

        need(self.replicas >= 1, f"--replicas must be >= 1, got {self.replicas}")
        if self.max_replicas is not None:
            lo = 1 if self.min_replicas is None else self.min_replicas
            need(lo >= 0, f"--min-replicas must be >= 0, got {lo}")
            need(self.max_replicas >= max(lo, 1),
                 f"--max-replicas ({self.max_replicas}) must be >= --min-replicas ({lo}) and >= 1")
        else:
            need(self.min_replicas is None, "--min-replicas needs --max-replicas (autoscaling bounds)")
        need(self.routing in ROUTINGS, f"--routing: one of {', '.join(ROUTINGS)}, not {self.routing!r}")
        need(self.prefix_chars >= 1, f"--prefix-chars must be >= 1, got {self.prefix_chars}")
        need(self.max_ongoing_requests >= 1,
             f"--max-ongoing-requests must be >= 1, got {self.max_ongoing_requests}")
        need(self.max_queued_requests == -1 or self.max_queued_requests >= 1,
             f"--max-queued-requests must be -1 (no limit) or >= 1, got {self.max_queued_requests}")
        need(self.target_ongoing_requests is None or self.target_ongoing_requests > 0,
             f"--target-ongoing-requests must be > 0, got {self.target_ongoing_requests}")
        need(self.retry_after_s >= 0, f"--retry-after must be >= 0, got {self.retry_after_s}")
        need(self.replica_cpus > 0 and self.ingress_cpus >= 0, "--replica-cpus must be > 0")
        need(self.stream_interval_ms >= 0, f"--stream-interval-ms: >= 0, not {self.stream_interval_ms}")
        need(self.ingress_replicas >= 1, f"--ingress-replicas must be >= 1, got {self.ingress_replicas}")
        need(len(self.served_model_names) >= 1, "at least one served model name")
        need(self.app_factory.count(":") == 1, f"app_factory is 'module:function', not {self.app_factory!r}")

    @property
    def autoscaling(self) -> dict[str, Any] | None:
        """Ray Serve's `autoscaling_config`, or None for a fixed replica count."""
        if self.max_replicas is None:
            return None
        lo = 1 if self.min_replicas is None else self.min_replicas
        target = self.target_ongoing_requests or max(1.0, self.max_ongoing_requests / 2)
        return {
            "min_replicas": lo,
            "max_replicas": self.max_replicas,
            "initial_replicas": min(max(self.replicas, lo), self.max_replicas),
            "target_ongoing_requests": target,
        }


def spec_from_args(args: argparse.Namespace, use_gpu: bool) -> DeploySpec:
    """The `DeploySpec` of parsed `metainfer serve` flags (raises ValueError on bad values)."""
    from metainfer.config import EngineConfig
    from metainfer.generate_cli import engine_kwargs
    from metainfer.settings import settings

    engine = {"model": args.model, **engine_kwargs(args)}
    if not use_gpu:
        engine["device"] = "cpu"
    EngineConfig(**engine)  # a bad engine flag or a missing model fails here, not in every replica
    if args.model and not str(args.model).startswith("dummy:"):
        from pathlib import Path

        if not Path(args.model).expanduser().is_dir():
            raise FileNotFoundError(f"model directory not found: {args.model}")
    ongoing = args.max_ongoing_requests or args.max_num_seqs
    # requests being routed count as queued too: room for a burst as large as every replica's share
    queued = args.max_queued_requests
    if queued is None:
        queued = (args.max_replicas or args.replicas) * ongoing
    return DeploySpec(
        engine=engine,
        served_model_names=tuple(args.served_model_name or [args.model or "default"]),
        api_key=args.api_key if args.api_key is not None else settings().api_key,
        generation_config=args.generation_config,
        max_logprobs=args.max_logprobs,
        reasoning_parser=args.reasoning_parser,
        shutdown_timeout=args.shutdown_timeout,
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        routing=args.routing,
        prefix_chars=args.prefix_chars,
        max_ongoing_requests=ongoing,
        max_queued_requests=queued,
        retry_after_s=args.retry_after,
        use_gpu=use_gpu,
        replica_cpus=args.replica_cpus,
        ingress_replicas=args.ingress_replicas or args.replicas,
        stream_interval_ms=args.stream_interval_ms,
    )
