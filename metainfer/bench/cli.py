"""`metainfer bench serve | offline | roofline | compare | report`.

Exit codes: 0 ok; 1 a run failed (failed or short requests, server not healthy, no result); 2 usage
error. Results are written (with `--json` / `--out`) before a failing exit.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from metainfer.config import FULL_CONFIG


def _err(msg: str) -> int:
    print(f"metainfer bench: error: {msg}", file=sys.stderr)
    return 2


def _argv(args: argparse.Namespace) -> list[str]:
    """The full command, every option spelled out (defaults included), rebuilt from the parsed args."""
    parser: argparse.ArgumentParser = args.bench_parser
    out = ["metainfer", "bench", args.bench_command]
    positionals: list[str] = []
    for a in parser._actions:
        if a.dest in ("help", "func", "bench_parser"):
            continue
        v = getattr(args, a.dest, None)
        if not a.option_strings:
            positionals += [str(x) for x in (v if isinstance(v, list) else [v])]
        elif a.nargs == 0:  # a flag
            out += [a.option_strings[0]] if v else []
        elif isinstance(v, list):
            for x in v:
                out += [a.option_strings[0], str(x)]
        elif v is not None:
            out += [a.option_strings[0], str(v)]
    return out + positionals


def _longest(dataset: Any, tokenizer_dir: str | None) -> tuple[list[Any], int]:
    """A dataset's requests and its longest sequence (prompt + output tokens)."""
    from metainfer.bench.datasets import load_requests
    from metainfer.tokenizer import load_tokenizer

    reqs = load_requests(dataset, load_tokenizer(tokenizer_dir))
    return reqs, max(r.prompt_len + r.output_len for r in reqs)


def _add_common(p: Any) -> None:
    p.add_argument("--json", metavar="OUT", help="write the result JSON here (default: none)")
    p.add_argument(
        "--verdict", metavar="PATH", help="oracle verdict JSON this result relies on (default: none)"
    )


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="streaming load test of an OpenAI-compatible /v1/completions server")
    w = p.add_argument_group("server and workload")
    w.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    w.add_argument("--model", default=None, help="model name sent in requests (default: from /v1/models)")
    w.add_argument("--dataset", default="random", help="random | structured | file:PATH (JSONL)")
    w.add_argument("--input-len", type=int, default=1024, metavar="N", help="prompt tokens")
    w.add_argument("--output-len", type=int, default=128, metavar="N", help="tokens to generate")
    w.add_argument("--num-prompts", type=int, default=100, metavar="N", help="requests timed")
    w.add_argument(
        "--max-concurrency", type=int, default=None, metavar="N", help="requests in flight (default: all)"
    )
    w.add_argument(
        "--request-rate", type=float, default=math.inf, help="req/s, Poisson arrivals; inf: all at once"
    )
    w.add_argument("--ignore-eos", action="store_true", help="ask for --output-len tokens past EOS")
    w.add_argument("--seed", type=int, default=0, help="seed of the random prompts and arrivals")
    d = p.add_argument_group("workload details")
    d.add_argument("--endpoint", default="/v1/completions", help="path of the completions endpoint")
    d.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform within +- this share of the lengths"
    )
    d.add_argument("--warmup", type=int, default=0, metavar="N", help="untimed requests sent first")
    d.add_argument(
        "--tokenizer", default=None, metavar="DIR", help="model dir with tokenizer.json (default: Qwen3.6)"
    )
    d.add_argument("--vocab-limit", type=int, default=None, metavar="N",
                   help="random ids stay below this (default: the vocab_size in the server's /v1/models)")
    d.add_argument("--timeout", type=float, default=6 * 3600.0, metavar="S", help="per-request timeout (s)")
    d.add_argument("--extra-body", default="", metavar="JSON",
                   help="a JSON object merged into every request, e.g. '{\"guided_json\": {...}}'")
    r = p.add_argument_group("results")
    r.add_argument("--label", default="server", help="engine name recorded in the result")
    r.add_argument("--workload", default=None, help="workload name in the result (default: from the run)")
    _add_common(r)
    roof = p.add_argument_group(
        "roofline", "the GPU and model the roofline rows assume (omitted when the server runs on a CPU or "
        "serves another model)"
    )
    roof.add_argument(
        "--config",
        default=None,
        help="model config for the roofline (default: --model if a "
        "path or dummy:PATH, else the full Qwen3.6 config)",
    )
    roof.add_argument("--dtype", choices=("bfloat16", "fp8"), default="bfloat16", help="roofline precision")
    roof.add_argument(
        "--lm-head-dtype", choices=("bfloat16", "fp8"), default=None, help="lm_head (default: bfloat16)"
    )
    roof.add_argument("--bandwidth", type=float, default=4.3, help="GPU memory TB/s (4.3: an H200)")
    p.set_defaults(func=cmd_serve, bench_parser=p)


def cmd_serve(args: argparse.Namespace) -> int:
    from metainfer.bench.client import ClientConfig
    from metainfer.bench.datasets import DatasetSpec
    from metainfer.bench.env import check_verdict, write_json
    from metainfer.bench.roofline import resolve_config_path
    from metainfer.bench.serve import RooflineSpec, run_ok, serve_benchmark

    try:
        if args.config:
            resolve_config_path(args.config, strict=True)
        card = _served_card(args.base_url)  # the served model, where the server says it
        if args.vocab_limit is None:  # random ids within the served model's vocabulary, when it says
            v = card.get("vocab_size")
            args.vocab_limit = v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
        dataset = DatasetSpec.parse(
            args.dataset,
            input_len=args.input_len,
            output_len=args.output_len,
            num_prompts=args.num_prompts,
            range_ratio=args.range_ratio,
            seed=args.seed,
            vocab_limit=args.vocab_limit,
        )
        reqs = None
        if args.verdict:  # refused before the server is touched
            reqs, longest = _longest(dataset, args.tokenizer)
            check_verdict(args.verdict, min(args.max_concurrency or len(reqs), len(reqs)), longest)
        if args.model is None:
            args.model = str(card.get("id") or "default")
        client = ClientConfig(
            base_url=args.base_url,
            model=args.model,
            endpoint=args.endpoint,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
            warmup=args.warmup,
            timeout_s=args.timeout,
            extra_body=args.extra_body,
        )
        roof = RooflineSpec(
            model=args.config or args.model,
            dtype=args.dtype,
            lm_head_dtype=args.lm_head_dtype,
            bandwidth=args.bandwidth,
        )
        obj, table, run = serve_benchmark(
            client,
            dataset,
            roof,
            engine=args.label,
            workload=args.workload,
            verdict=args.verdict,
            argv=_argv(args),
            tokenizer_dir=args.tokenizer,
            reqs=reqs,
            server_card=card,
        )
    except (ValueError, FileNotFoundError) as e:
        return _err(str(e))
    m = run.metrics
    if m.completed == 0:  # a table of nan says nothing: the first errors say what went wrong
        first = "; ".join(m.errors[:2]) or "no request completed"
        print(f"error: all {m.failed} requests failed: {first}", file=sys.stderr)
    else:
        print(table)
    if args.json:
        print(f"wrote {write_json(args.json, obj)}")
    return 0 if run_ok(m) else 1


def _served_card(base_url: str) -> dict[str, Any]:
    """The first model of the server's /v1/models ({} when it lists none or cannot be reached)."""
    import asyncio

    from metainfer.bench.client import served_model_card

    return asyncio.run(served_model_card(base_url)) or {}


def _add_offline(sub: Any) -> None:
    p = sub.add_parser("offline", help="the engine's Python API without HTTP (prefill and decode timing)")
    g = p.add_argument_group("model and workload")
    g.add_argument("--model", default="", help="model dir, dummy:CONFIG, or '' for the default model")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--dtype", choices=("bfloat16", "float32", "fp8"), default="bfloat16", help="precision")
    g.add_argument("--input-len", type=int, default=1024, metavar="N", help="prompt tokens")
    g.add_argument("--output-len", type=int, default=128, metavar="N", help="tokens to generate")
    g.add_argument("--batch-size", type=int, default=1, metavar="N", help="prompts in the batch")
    g.add_argument("--num-iters", type=int, default=3, metavar="N", help="timed iterations (median taken)")
    g.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed iterations first")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    r = p.add_argument_group("results")
    _add_common(r)
    roof = p.add_argument_group("roofline", "omitted on a CPU run")
    roof.add_argument("--bandwidth", type=float, default=4.3, help="GPU memory TB/s (4.3: an H200)")
    p.set_defaults(func=cmd_offline, bench_parser=p)


def cmd_offline(args: argparse.Namespace) -> int:
    from metainfer.bench.env import check_verdict, write_json
    from metainfer.bench.offline import OfflineConfig, offline_benchmark

    try:
        cfg = OfflineConfig(
            model=args.model,
            input_len=args.input_len,
            output_len=args.output_len,
            batch_size=args.batch_size,
            num_iters=args.num_iters,
            warmup=args.warmup,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            bandwidth=args.bandwidth,
        )
        check_verdict(args.verdict, cfg.batch_size, cfg.input_len + cfg.output_len)
    except ValueError as e:
        return _err(str(e))
    try:
        obj, text, m = offline_benchmark(cfg, verdict=args.verdict, argv=_argv(args))
    except ImportError as e:
        print(f"metainfer bench offline: the engine API is not available: {e}", file=sys.stderr)
        return 1
    print(text)
    if args.json:
        print(f"wrote {write_json(args.json, obj)}")
    return 1 if m.short_outputs else 0


def _add_roofline(sub: Any) -> None:
    p = sub.add_parser("roofline", help="bytes and FLOPs per decode step / prefill, and the ceilings")
    p.add_argument("--model", default=str(FULL_CONFIG), help="config.json, model dir or dummy:CONFIG")
    p.add_argument("--dtype", choices=("bfloat16", "fp8"), default="bfloat16", help="weights")
    p.add_argument("--lm-head-dtype", choices=("bfloat16", "fp8"), default=None, help="default: bfloat16")
    p.add_argument("--kv-dtype", choices=("bfloat16", "fp8"), default="bfloat16", help="KV cache")
    p.add_argument("--bandwidth", type=float, default=4.3, help="GPU memory TB/s (4.3: an H200)")
    p.add_argument("--tflops", type=float, default=None, help="peak TFLOP/s (default 790 BF16, 1580 FP8)")
    p.add_argument("--context", type=int, default=0, help="cached tokens per sequence at decode")
    p.add_argument("--concurrency", type=int, default=1, help="sequences per decode step")
    p.add_argument("--prefill-len", type=int, default=1024, help="prompt tokens of the prefill")
    p.add_argument(
        "--markdown", action="store_true", help="print the byte-count tables (benchmarks/README.md)"
    )
    p.add_argument("--json", metavar="OUT", help="write the result JSON here (default: none)")
    p.set_defaults(func=cmd_roofline, bench_parser=p)


def cmd_roofline(args: argparse.Namespace) -> int:
    from metainfer.bench.env import build_result, write_json
    from metainfer.bench.roofline import decode_ceiling, format_ceiling, load_config, prefill_floor

    try:
        cfg, path = load_config(args.model, strict=True)
        dec = decode_ceiling(
            cfg,
            args.dtype,
            args.concurrency,
            args.context,
            args.bandwidth,
            args.lm_head_dtype,
            args.kv_dtype,
            args.tflops,
        )
        pre = prefill_floor(
            cfg, args.dtype, args.prefill_len, args.bandwidth, args.lm_head_dtype, args.kv_dtype, args.tflops
        )
    except (ValueError, FileNotFoundError) as e:
        return _err(str(e))
    if args.markdown:
        from metainfer.bench.roofline_doc import markdown_tables

        print(markdown_tables(cfg, args.bandwidth, design=path == FULL_CONFIG), end="")
        return 0
    print(f"config: {path}")
    print(format_ceiling(dec, "decode step"))
    print(format_ceiling(pre, "prefill"))
    if args.json:
        obj = build_result(
            kind="roofline",
            engine="-",
            workload="roofline",
            config=vars_clean(args),
            metrics={"decode": dec.to_dict(), "prefill": pre.to_dict()},
            argv=_argv(args),
        )
        print(f"wrote {write_json(args.json, obj)}")
    return 0


def vars_clean(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("func", "bench_parser")}


def _add_compare(sub: Any) -> None:
    p = sub.add_parser("compare", help="start each engine's server in turn and run the same workloads")
    p.add_argument(
        "--engine",
        action="append",
        default=None,
        help="metainfer | vllm | a --engine-cmd name (repeatable; default: metainfer and vllm)",
    )
    p.add_argument(
        "--engine-cmd",
        action="append",
        default=[],
        metavar="NAME=TEMPLATE",
        help="server command with {port} {model} {model_dir} {config} (repeatable)",
    )
    p.add_argument(
        "--model", default=f"dummy:{FULL_CONFIG}", help="dummy:CONFIG (same config for every engine)"
    )
    p.add_argument("--workload", default="c1,ttft,c32", help="comma list of c1, ttft, cN")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=1024, help="tokens to generate")
    p.add_argument(
        "--num-prompts", type=int, default=None, help="requests per workload (default: c1 4, ttft 8, cN 4N)"
    )
    p.add_argument("--dataset", default="random", help="random | structured | file:PATH (JSONL)")
    p.add_argument("--dtype", choices=("bfloat16", "fp8"), default="bfloat16", help="weights of every engine")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests per workload")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to start")
    p.add_argument(
        "--tokenizer-dir", default=None, help="tokenizer files copied into vLLM's model dir (default: none)"
    )
    p.add_argument("--bandwidth", type=float, default=4.3, help="roofline: GPU memory TB/s (4.3: an H200)")
    p.add_argument("--baseline", default=None, help="engine the report's ratios divide by (default vllm)")
    p.add_argument(
        "--verdict", metavar="PATH", help="oracle verdict JSON the results rely on (default: none)"
    )
    p.add_argument("--out", default="out/bench-compare", help="folder of the results and the report")
    p.set_defaults(func=cmd_compare, bench_parser=p)


def cmd_compare(args: argparse.Namespace) -> int:
    from metainfer.bench.compare import CompareConfig, parse_workloads, run_compare
    from metainfer.bench.report import write_report

    try:
        templates = []
        for item in args.engine_cmd:
            name, sep, tmpl = item.partition("=")
            if not sep or not name or not tmpl:
                raise ValueError(f"--engine-cmd needs NAME=TEMPLATE, got {item!r}")
            templates.append((name, tmpl))
        engines = args.engine or (["metainfer", "vllm"] if not templates else [])
        engines += [n for n, _ in templates if n not in engines]
        cfg = CompareConfig(
            engines=tuple(engines),
            model=args.model,
            workloads=tuple(
                parse_workloads(args.workload, args.input_len, args.output_len, args.num_prompts)
            ),
            out_dir=Path(args.out),
            dtype=args.dtype,
            dataset=args.dataset,
            seed=args.seed,
            warmup=args.warmup,
            startup_timeout_s=args.startup_timeout,
            tokenizer_dir=args.tokenizer_dir,
            templates=tuple(templates),
            bandwidth=args.bandwidth,
            verdict=args.verdict,
            baseline=args.baseline,
        )
        from metainfer.bench.compare import config_file

        if not config_file(cfg.model).is_file():
            raise ValueError(f"no config at {config_file(cfg.model)}")
        if cfg.verdict:  # every workload, before any server starts
            from metainfer.bench.datasets import DatasetSpec
            from metainfer.bench.env import check_verdict

            for w in cfg.workloads:
                spec = DatasetSpec.parse(cfg.dataset, input_len=w.input_len, output_len=w.output_len,
                                         num_prompts=w.num_prompts, seed=cfg.seed)
                reqs, longest = _longest(spec, cfg.tokenizer_dir)
                check_verdict(cfg.verdict, min(w.max_concurrency, len(reqs)), longest)
    except (ValueError, FileNotFoundError) as e:
        return _err(str(e))
    files, ok = run_compare(cfg, argv=_argv(args))
    if files:
        md, pngs = write_report(files, cfg.out_dir, cfg.baseline)
        print(f"wrote {len(files)} results, {md} and {len(pngs)} plots")
    return 0 if ok else 1


def _add_report(sub: Any) -> None:
    p = sub.add_parser("report", help="markdown table and PNG plots from result JSONs")
    p.add_argument("results", nargs="+", help="result JSON files or directories")
    p.add_argument("--out", default="out/bench-report", help="folder of the report")
    p.add_argument("--baseline", default=None, help="engine for ratios (default: vllm if present)")
    p.set_defaults(func=cmd_report, bench_parser=p)


def cmd_report(args: argparse.Namespace) -> int:
    from metainfer.bench.report import write_report

    try:
        md, pngs = write_report(args.results, args.out, args.baseline)
    except ValueError as e:
        return _err(str(e))
    print(md.read_text())
    print(f"wrote {md} and {len(pngs)} plots")
    return 0


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="serving/offline benchmarks, roofline, compare, report")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
    _add_serve(sub)
    _add_offline(sub)
    _add_roofline(sub)
    _add_compare(sub)
    _add_report(sub)
