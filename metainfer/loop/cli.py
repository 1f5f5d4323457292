"""`metainfer loop init|judge|run|tune` and `metainfer tune`: the closed loop (docs/loop.md).

Exit codes: judge 0 accepted, 1 rejected; run and tune 0 when they end normally, 1 when the judge could
not judge; every command 2 on a usage error (one `error:` line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "loop",
        help="the closed loop: an immutable judge, a git ratchet and any coding agent",
        description="Point a coding agent at the engine: each change is judged by the base "
        "revision's oracle and bench, and kept only if it passes and is faster (docs/loop.md).",
    )
    loop = p.add_subparsers(dest="loop_command", metavar="ACTION")

    init = loop.add_parser("init", help="write loop.toml: boundary, goal metrics, judge commands, budgets")
    init.add_argument("--target", default="qwen", choices=["qwen", "sam"], help="what the engine serves")
    init.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the judge measures")
    init.add_argument(
        "--model",
        default=None,
        help="model dir or dummy:CONFIG (default: the embedded model on cpu, the full config's "
        "dummy weights on cuda)",
    )
    init.add_argument("--dtype", default=None, help="precision (default: float32 on cpu, fp8 on cuda)")
    init.add_argument(
        "--gpu", default=None, help="GPU name the figures hold for (default: cpu, or H200 on cuda)"
    )
    init.add_argument(
        "--agent", default="", help="the agent's command (default: none; loop run --agent gives it)"
    )
    init.add_argument("--out", type=Path, default=Path("loop.toml"), help="where to write it")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(func=_init)

    judge = loop.add_parser(
        "judge", help="judge one candidate commit against its base (exit 0 accepted, 1 rejected)"
    )
    judge.add_argument(
        "--base",
        required=True,
        help="the base revision, whose oracle, bench and tests judge (required, no default)",
    )
    judge.add_argument("--candidate", required=True, help="the candidate revision (required, no default)")
    _common(judge)
    judge.add_argument(
        "--work",
        type=Path,
        default=None,
        help="folder of the judge's logs and JSONs (default: RUN_DIR/judge/BASE-CANDIDATE)",
    )
    judge.add_argument("--json", type=Path, default=None, help="write the verdict here (default: none)")
    judge.add_argument("--no-record", action="store_true", help="write no KB record")
    judge.add_argument("--no-ratchet", action="store_true", help="leave the ratchet branch alone")
    judge.add_argument(
        "--in-place",
        action="store_true",
        help="judge with this checkout's metainfer/loop, not the base revision's (which `loop judge` "
        "otherwise runs, from a copy taken with git archive)",
    )
    judge.set_defaults(func=_judge)

    run = loop.add_parser(
        "run", help="agent, judge, ratchet until a budget ends or the goal is met (resumable)"
    )
    run.add_argument(
        "--agent",
        default=None,
        help="shell command run in the worktree with the brief's path as its last argument "
        "(or in place of {brief}); default: loop.toml's agent.command",
    )
    _common(run)
    run.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="the run's folder: state, briefs, verdicts, report; an existing one is resumed "
        "(default: RUN_DIR/run)",
    )
    run.add_argument("--base", default=None, help="where the ratchet starts (default: its head, else HEAD)")
    run.add_argument("--iterations", type=int, default=None, help="iteration budget (default: loop.toml's)")
    run.set_defaults(func=_run)

    _tune_args(loop.add_parser("tune", help="sweep a kernel's configs, write the tuned table, judge it"))
    _tune_args(sub.add_parser("tune", help="same as `metainfer loop tune`"))
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="loop.toml (default: the repository's, else the embedded model's CPU defaults)",
    )
    p.add_argument("--repo", type=Path, default=Path("."), help="the git repository")


def _tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel", required=True, help="the kernel to sweep: fp8_skinny (required, no default)")
    p.add_argument("--tokens", default="1", help="token counts T of the shapes, comma-separated")
    p.add_argument("--linears", default="", help="fp8_skinny: which projections (default: all)")
    p.add_argument(
        "--base", default=None, help="commit the table on this (default: the ratchet's head, else HEAD)"
    )
    p.add_argument("--min-gain", type=float, default=0.02, help="a config must beat the default by this much")
    p.add_argument("--no-judge", action="store_true", help="commit the table but do not judge it")
    _common(p)
    p.set_defaults(func=_tune)


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _setup(args: argparse.Namespace):
    """(repo, config) or raises ValueError with the message for an `error:` line."""
    from metainfer.loop import gitops
    from metainfer.loop.config import load, parse
    from metainfer.loop.template import defaults

    try:
        repo = gitops.toplevel(args.repo.resolve())
    except (gitops.GitError, OSError):
        raise ValueError(f"{args.repo} is not in a git repository") from None
    path = args.config or repo / "loop.toml"
    if args.config is None and not path.exists():
        return repo, parse(defaults("qwen", "cpu", None, None, None), "defaults")
    return repo, load(path)


def _init(args: argparse.Namespace) -> int:
    from metainfer.loop.config import ConfigError, parse
    from metainfer.loop.template import defaults, render

    if args.out.exists() and not args.force:
        return _error(f"{args.out} exists (--force overwrites it)")
    try:
        tables = defaults(args.target, args.device, args.model, args.dtype, args.gpu)
        tables["agent"]["command"] = args.agent
        text = render(tables)
        import tomllib

        parse(tomllib.loads(text))
    except ConfigError as e:
        return _error(str(e))
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    except OSError as e:
        return _error(f"cannot write {args.out}: {e}")
    print(
        f"wrote {args.out}: target {args.target} on {args.device}; edit it, commit it, then "
        "`metainfer loop run --agent CMD`"
    )
    return 0


def _judge(args: argparse.Namespace) -> int:
    from metainfer.loop import gitops, record
    from metainfer.loop.config import ConfigError
    from metainfer.loop.judge import Judge, JudgeError

    try:
        repo, cfg = _setup(args)
        base, cand = gitops.rev(repo, args.base), gitops.rev(repo, args.candidate)
    except (ValueError, ConfigError) as e:
        return _error(str(e))
    except gitops.GitError:
        return _error(f"not a commit: {args.base if not gitops.exists(repo, args.base) else args.candidate}")
    work = (args.work or _run_root(repo, cfg) / "judge" / f"{base[:10]}-{cand[:10]}").resolve()
    if repo in work.parents:  # never committed by accident
        gitops.exclude(repo, "/" + work.relative_to(repo).parts[0] + "/")
    if not args.in_place:
        rc = _judge_frozen(args, repo, base, cand, work)
        if rc is not None:
            return rc
    try:
        v = Judge(repo, cfg, work, lambda m: print(m, file=sys.stderr, flush=True)).judge(base, cand)
    except JudgeError as e:
        return _error(str(e))
    if not args.no_record and v.category != "empty":
        v.record = str(record.write(v, cfg, repo))
    if v.accepted and not args.no_ratchet:
        v.ratchet = gitops.fast_forward(repo, cfg.ratchet, cand)
    v.save(work / "verdict.json")
    _print_verdict(v)
    if args.json:
        try:
            args.json.write_text(json.dumps(v.to_dict(), indent=1))
        except OSError as e:
            return _error(f"cannot write {args.json}: {e} (the verdict is in {work / 'verdict.json'})")
    return 0 if v.accepted else 1


def _judge_frozen(args: argparse.Namespace, repo: Path, base: str, cand: str, work: Path) -> int | None:
    """Runs this same judge with the base revision's own metainfer package (a git archive copy, run from
    its folder, so that neither this checkout nor the candidate's code is imported): its exit code, or
    None when the base has no metainfer/loop to run."""
    import os
    import shutil
    import subprocess

    from metainfer.loop import gitops

    code = work / "judge-code"
    shutil.rmtree(code, ignore_errors=True)
    try:
        gitops.extract(repo, base, code, "metainfer", ":(exclude)metainfer/assets")
    except gitops.GitError:
        pass
    cli = code / "metainfer" / "loop" / "cli.py"
    if not cli.is_file() or "--in-place" not in cli.read_text():
        print(
            f"judge: {base[:10]} has no metainfer/loop judge to run: judging with this checkout's",
            file=sys.stderr,
        )
        shutil.rmtree(code, ignore_errors=True)
        return None
    argv = [
        sys.executable,
        "-m",
        "metainfer.cli",
        "loop",
        "judge",
        "--in-place",
        "--repo",
        str(repo),
        "--base",
        base,
        "--candidate",
        cand,
        "--work",
        str(work),
    ]
    argv += ["--config", str(args.config.resolve())] if args.config else []
    argv += ["--json", str(args.json.resolve())] if args.json else []
    argv += ["--no-record"] * args.no_record + ["--no-ratchet"] * args.no_ratchet
    print(f"judge: running the base revision's metainfer/loop ({base[:10]})", file=sys.stderr, flush=True)
    try:
        return subprocess.run(argv, cwd=code, env={**os.environ, "PYTHONPATH": str(code)}).returncode
    finally:
        shutil.rmtree(code, ignore_errors=True)


def _print_verdict(v) -> None:
    if v.figures:
        print("| metric | base | candidate | change | band | tolerance |")
        print("|---|---|---|---|---|---|")
        for name, f in v.figures.items():
            print(
                f"| {name} | {f['base_median']:.4g} | {f['candidate_median']:.4g} "
                f"| {100 * f['change']:+.1f}% | {100 * f['band']:.1f}% | {100 * f['tolerance']:.1f}% |"
            )
    print(f"oracle: {v.oracle.get('summary') or 'not run'}")
    for f in v.findings:
        print(f"tamper: {f}")
    if v.record:
        print(f"record: {v.record}")
    if v.ratchet:
        print(f"ratchet: {v.ratchet}")
    print(f"verdict: {'ACCEPTED' if v.accepted else 'REJECTED'} ({v.category}): {v.reason}")


def _run_root(repo: Path, cfg) -> Path:
    d = Path(cfg.run_dir)
    return d if d.is_absolute() else repo / d


def _run(args: argparse.Namespace) -> int:
    from metainfer.loop import gitops
    from metainfer.loop.config import ConfigError
    from metainfer.loop.judge import JudgeError
    from metainfer.loop.run import LoopRun

    try:
        repo, cfg = _setup(args)
    except (ValueError, ConfigError) as e:
        return _error(str(e))
    agent = args.agent if args.agent is not None else cfg.agent_command
    if not agent.strip():
        return _error("no agent: pass --agent CMD or set agent.command in loop.toml")
    if args.iterations is not None:
        if args.iterations < 1:
            return _error("--iterations must be >= 1")
        import dataclasses

        cfg = dataclasses.replace(cfg, iterations=args.iterations)
    root = (args.run_dir or _run_root(repo, cfg) / "run").resolve()
    try:
        loop = LoopRun(repo, cfg, agent, root, args.base, lambda m: print(m, file=sys.stderr, flush=True))
    except gitops.GitError:
        return _error(f"not a commit: {args.base}" if args.base else f"{repo}: no HEAD commit to start from")
    except (ValueError, OSError) as e:
        return _error(str(e))
    try:
        why = loop.run()
    except JudgeError as e:
        print(f"error: the judge could not judge: {e}", file=sys.stderr)
        return 1
    except gitops.GitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"stopped: {why}\nreport: {root / 'report.md'}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    from metainfer.loop.config import ConfigError
    from metainfer.loop.judge import JudgeError
    from metainfer.loop.tune import KERNELS, load_kernel, tune

    if args.kernel not in KERNELS:
        return _error(f"unknown kernel {args.kernel!r}; known: {', '.join(KERNELS)}")
    try:
        tokens = tuple(int(t) for t in args.tokens.split(",") if t.strip())
    except ValueError:
        return _error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    if not tokens or min(tokens) < 1:
        return _error("--tokens: at least one positive token count")
    try:
        repo, cfg = _setup(args)
    except (ValueError, ConfigError) as e:
        return _error(str(e))
    import torch

    if not torch.cuda.is_available():
        return _error(f"metainfer loop tune sweeps CUDA kernels ({args.kernel}): this machine has no GPU")
    if not args.no_judge and not cfg.boundary.device.startswith("cuda"):
        return _error(
            f"{cfg.source}: the boundary's device is {cfg.boundary.device}; a GPU kernel's table is "
            "judged on the GPU (metainfer loop init --device cuda), or pass --no-judge"
        )
    gpu = torch.cuda.get_device_name()
    try:
        kernel = load_kernel(
            args.kernel, tokens=tokens, linears=tuple(x for x in args.linears.split(",") if x)
        )
    except ValueError as e:
        return _error(str(e))
    root = _run_root(repo, cfg) / "tune" / args.kernel
    try:
        r = tune(
            repo,
            cfg,
            kernel,
            gpu,
            root,
            args.base,
            not args.no_judge,
            args.min_gain,
            lambda m: print(m, file=sys.stderr, flush=True),
        )
    except JudgeError as e:
        print(f"error: the judge could not judge: {e}", file=sys.stderr)
        return 1
    if r.verdict:
        _print_verdict(r.verdict)
    print(f"tune: {len(r.winners)} shapes improved; {r.message}")
    return 0
