"""`metainfer serve --replicas N`: the replica flags, and the run that hands the server to Ray Serve.
Imports no Ray until `run_replicas` runs (the flags are registered on every `metainfer serve`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

from metainfer.deploy.spec import ROUTINGS, spec_from_args

log = logging.getLogger("metainfer.deploy")


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "replicas (Ray Serve)",
        "more than one engine behind this endpoint, one GPU each (needs `pip install -e '.[ray]'`)",
    )
    g.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="engine replicas; above 1 (or with --max-replicas) the server runs on Ray Serve")
    g.add_argument("--min-replicas", type=int, default=None, metavar="N",
                   help="autoscaling: fewest replicas (default: 1 when --max-replicas is given)")
    g.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help="autoscaling: most replicas (default: no autoscaling, --replicas fixed)")
    g.add_argument("--target-ongoing-requests", type=float, default=None, metavar="N",
                   help="autoscaling: requests in flight per replica to scale towards (default: half of "
                   "--max-ongoing-requests)")
    g.add_argument("--routing", default="least-loaded", choices=ROUTINGS,
                   help="least-loaded: the replica with the fewest requests in flight; prefix: a "
                   "conversation's turns go to one replica (its cached prefix), least-loaded when it is full")
    g.add_argument("--prefix-chars", type=int, default=512, metavar="N",
                   help="prefix routing: characters of a prompt (of each opening chat message) that key it")
    g.add_argument("--max-ongoing-requests", type=int, default=None, metavar="N",
                   help="requests one replica takes at once (default: --max-num-seqs)")
    g.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="requests not yet on a replica (waiting or being routed), per ingress, before 429 "
                   "(-1: no limit; default: --max-ongoing-requests x the most replicas)")
    g.add_argument("--retry-after", type=float, default=1.0, metavar="S", help="a 429's Retry-After, seconds")
    g.add_argument("--replica-cpus", type=float, default=1.0, metavar="N", help="CPUs reserved per replica")
    g.add_argument("--ingress-replicas", type=int, default=None, metavar="N",
                   help="HTTP ingress replicas relaying to the engines (default: --replicas; each relays "
                   "every streamed chunk of its requests)")
    g.add_argument("--stream-interval-ms", type=float, default=0.0, metavar="MS",
                   help="a stream's chunks after the first leave a replica at least MS apart (what "
                   "arrives meanwhile goes as one): fewer relayed items at high concurrency, burstier "
                   "streams; 0: each as soon as it is ready")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="Ray cluster to join (default: the environment's RAY_ADDRESS, else a new local one)")


def wants_replicas(args: argparse.Namespace) -> bool:
    return getattr(args, "replicas", 1) > 1 or getattr(args, "max_replicas", None) is not None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_replicas(args: argparse.Namespace) -> int:
    """Serves until SIGINT/SIGTERM, then deletes the application (and stops a Ray it started)."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print("error: --replicas/--max-replicas need Ray Serve: pip install -e '.[ray]'", file=sys.stderr)
        return 2
    from metainfer.deploy import ray_serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        spec = spec_from_args(args, use_gpu=args.device != "cpu")  # refined once Ray is up
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ray.init(address=args.ray_address, logging_level=logging.WARNING)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM: the same clean exit as Ctrl-C
    try:
        spec = spec_from_args(args, use_gpu=ray_serve.uses_gpu(args.device))
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(ray_serve.application(spec), name=ray_serve.APP_NAME, route_prefix="/")
        except RuntimeError as e:  # a replica's constructor failed on every retry
            print(f"error: the replicas did not start: {e}", file=sys.stderr)
            return 1
        scale = f"autoscaled {spec.autoscaling}" if spec.autoscaling else f"{spec.replicas} replicas"
        log.info("serving %s on http://%s:%d: %s, %s routing", spec.served_model_names, args.host, args.port,
                 scale, spec.routing)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    finally:
        try:
            serve.delete(ray_serve.APP_NAME)
        finally:
            ray.shutdown()
