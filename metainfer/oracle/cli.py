"""`metainfer verify`: judge the engine against transformers' reference on the same weights.

Exit code 0 when every check passes, 1 when any fails, 2 on a usage error (bad flags, a model that
cannot be found, a precision this build cannot run).
"""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from metainfer.generate_cli import add_engine_args

    p = sub.add_parser(
        "verify",
        help="accuracy oracle: engine vs transformers' Qwen3_5MoeForCausalLM on the same weights",
        description="Runs a seeded prompt suite through the engine as one continuous batch, teacher-forces "
        "transformers' reference along the engine's continuations, and prints every check with its "
        "figure and gate. Exit 0: pass, 1: fail, 2: usage error.",
    )
    v = p.add_argument_group("verification")
    v.add_argument(
        "--suite",
        default="auto",
        choices=["auto", "quick", "full"],
        help="quick: small, for CPU CI; full: 1..4000-token prompts and real text (auto: full on CUDA)",
    )
    v.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the prompt suite")
    v.add_argument(
        "--reference",
        default="auto",
        choices=["auto", "shared", "checkpoint"],
        help="HF dirs: load the checkpoint again with transformers (checkpoint) or reuse the "
        "engine's loaded tensors (shared); auto loads it again when it fits",
    )
    v.add_argument("--json", default=None, metavar="OUT", help="write the JSON verdict here (default: none)")
    add_engine_args(p)
    # unset means: sized to the suite (see metainfer.oracle.build.engine_defaults)
    sized = ("max_num_batched_tokens", "max_model_len", "max_num_seqs")
    p.set_defaults(func=run, **dict.fromkeys(sized))
    for a in p._actions:
        if a.dest in sized:
            a.help = f"{a.help} (default: sized to the suite)"


def run(args: argparse.Namespace) -> int:
    import torch

    from metainfer.generate_cli import engine_kwargs
    from metainfer.oracle.build import OracleSetupError, build_setup
    from metainfer.oracle.report import format_table, write_verdict
    from metainfer.oracle.verify import verify_setup

    suite = args.suite
    if suite == "auto":
        cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
        suite = "full" if cuda else "quick"
    kwargs = engine_kwargs(args)
    try:
        setup = build_setup(args.model, suite, kwargs, seed=args.seed, reference=args.reference)
    except (OracleSetupError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: verify needs transformers (pip install 'metainfer[oracle]'): {e}", file=sys.stderr)
        return 2
    s = setup.suite
    print(
        f"verify: model={args.model or 'default'} precision={setup.precision} "
        f"device={setup.llm.engine.runner.device} suite={s.name} ({len(s.prompts)} prompts, "
        f"{min(len(p) for p in s.prompts)}..{max(len(p) for p in s.prompts)} tokens, "
        f"{s.gen_tokens} generated each, chunk {setup.llm.engine.ecfg.max_num_batched_tokens})",
        file=sys.stderr,
    )
    verdict = verify_setup(
        setup, context=setup.context(args.model), log=lambda m: print(m, file=sys.stderr, flush=True)
    )
    print(format_table(verdict))
    st = verdict.figures.get("engine_stats", {})
    if st.get("spec_verifies"):  # what the speculative verify path was judged on
        print(f"speculative: {st['spec_accepted']} of {st['spec_drafted']} drafts accepted over "
              f"{st['spec_verifies']} verifies ({setup.llm.engine.ecfg.speculative})")
    cov = verdict.figures.get("coverage") or {}
    if cov:  # what `metainfer bench --verdict` may rely on
        print(f"coverage: decode steps up to {cov.get('max_decode_batch')} sequences, contexts up to "
              f"{cov.get('max_position')} tokens, {cov.get('lone_prefill_steps')} lone prefills, "
              f"{cov.get('preemptions')} preemptions, {cov.get('spec_verifies')} speculative verifies")
    for note in setup.notes:
        print(f"note: {note}")
    if args.json:
        print(f"verdict written to {write_verdict(args.json, verdict)}", file=sys.stderr)
    return 0 if verdict.passed else 1
