"""`metainfer generate`: run prompts through the engine as one continuous batch."""

from __future__ import annotations

import argparse
import json
import sys

from metainfer.config import SSM_STATE_DTYPES


def _token_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by generate, serve and verify, in three help groups after the command's
    own: the model and device; the engine's capacity; GPU performance tuning."""
    m = p.add_argument_group("model and device")
    m.add_argument(
        "--model",
        default="",
        help="model dir, dummy:CONFIG_JSON (random weights), or empty for the embedded default "
        "(a tiny code model; default: empty)",
    )
    m.add_argument(
        "--device", default="auto", metavar="DEV", help="cpu | cuda | auto (cuda if a GPU is present)"
    )
    m.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32", "fp8"],
        help="fp8 = bfloat16 activations with FP8 (e4m3, 128x128 block) weights",
    )
    m.add_argument(
        "--quantization",
        default=None,
        choices=["fp8", "none"],
        help="fp8: FP8 weights, as --dtype fp8; none: unquantised weights (default: as config.json "
        "declares: an FP8 checkpoint loads as FP8)",
    )
    m.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="dummy: random weights of the model's shapes",
    )
    m.add_argument(
        "--engine-seed", type=int, default=0, metavar="N", help="seed of dummy weights and unseeded sampling"
    )

    c = p.add_argument_group("engine capacity", "memory and batch limits")
    c.add_argument("--max-model-len", type=int, default=8192, help="longest prompt + output, in tokens")
    c.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one step")
    c.add_argument(
        "--max-num-batched-tokens", type=int, default=4096, help="tokens in a step (longer prompts: chunked)"
    )
    c.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    c.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV-cache blocks (default: sized from --gpu-memory-utilization on CUDA, a fixed count on CPU)",
    )
    c.add_argument(
        "--gpu-memory-utilization", type=float, default=0.90, help="CUDA: share of GPU memory to take"
    )
    c.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached KV blocks and DeltaNet state snapshots of earlier prompts' prefixes (default: "
        "on; --no-prefix-caching is --no-enable-prefix-caching)",
    )
    c.add_argument(
        "--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS
    )
    c.add_argument(
        "--prefix-snapshot-interval",
        type=int,
        default=None,
        help="prefix caching: prompt chunks also stop every N tokens (rounded up to whole blocks) and, for "
        "a prompt of N tokens or more, at its last block boundary, to snapshot the DeltaNet states there "
        "(default: --max-num-batched-tokens)",
    )
    c.add_argument(
        "--num-snapshot-slots",
        type=int,
        default=None,
        help="prefix caching: DeltaNet state snapshots kept (default: a quarter of the cache memory on "
        "CUDA, a fixed count on CPU)",
    )

    t = p.add_argument_group(
        "GPU performance tuning", "the defaults suit most runs; most of these do nothing on the CPU"
    )
    t.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    t.add_argument(
        "--prefill-graphs",
        type=_sizes,
        default=None,
        help="step sizes (e.g. 512,1024) of CUDA graphs for a prompt alone in a step (idle TTFT); "
        "default: 128,256,512,1024,2048 up to --max-num-batched-tokens; 0: none",
    )
    t.add_argument("--no-warmup", action="store_true", help="no start-up steps compiling the kernels")
    t.add_argument(
        "--fp8-lm-head",
        action="store_true",
        help="with fp8: the lm_head in FP8 too (half its bytes per decode step; the published FP8 "
        "checkpoint keeps it BF16)",
    )
    t.add_argument(
        "--speculative",
        default=None,
        choices=["ngram", "repeat", "mtp"],
        help="speculative decoding of greedy requests: ngram = prompt-lookup drafts; repeat = the last "
        "token K times (judges the verify path with `metainfer verify`: every eligible step verifies); "
        "mtp = the checkpoint's multi-token-prediction layer, chained K times (default: none)",
    )
    t.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per sequence and step")
    t.add_argument(
        "--speculative-max-seqs",
        type=int,
        default=1,
        help="draft only while at most this many sequences run and none waits (a lone verify replays "
        "a CUDA graph; verifies beside other sequences run eager)",
    )
    t.add_argument(
        "--speculative-draft-vocab",
        type=int,
        default=0,
        help="mtp: draft only among the token ids below N (lm_head's first N rows per draft; 32768 is ~1/8 "
        "of its bytes and ~95 %% of English/code tokens); 0: the whole vocabulary",
    )
    t.add_argument(
        "--ssm-state-dtype",
        default="float32",
        choices=SSM_STATE_DTYPES,
        help="storage of the DeltaNet recurrent states (the update math is fp32 either way)",
    )


def _sizes(text: str) -> tuple[int, ...]:
    if text.strip() in ("0", "none", ""):
        return ()
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    dtype, quant = args.dtype, args.quantization
    if dtype == "fp8":
        dtype, quant = "bfloat16", "fp8"
    return dict(
        dtype=dtype,
        quantization=quant,
        fp8_lm_head=args.fp8_lm_head,
        device=args.device,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_snapshot_interval=args.prefix_snapshot_interval,
        num_snapshot_slots=args.num_snapshot_slots,
        enforce_eager=args.enforce_eager,
        prefill_graphs=args.prefill_graphs,
        warmup=not args.no_warmup,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_max_seqs=args.speculative_max_seqs,
        speculative_draft_vocab=args.speculative_draft_vocab,
        ssm_state_dtype=args.ssm_state_dtype,
        seed=args.engine_seed,
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for prompts (one continuous batch)",
        description="Generates a continuation of each prompt (read from standard input when none is "
        "given) and prints it.",
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts")
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt text (repeatable)")
    g.add_argument(
        "--prompt-token-ids",
        action="append",
        default=[],
        type=_token_ids,
        metavar="IDS",
        help="a prompt as comma-separated token ids (repeatable)",
    )
    g.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1: off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="only the k likeliest tokens (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P", help="drop tokens under P x the top one")
    g.add_argument("--seed", type=int, default=None, metavar="N", help="sampling seed (default: unseeded)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="go on to --max-tokens past end-of-sequence")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    add_engine_args(p)
    p.set_defaults(func=run)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run(args: argparse.Namespace) -> int:
    from metainfer.engine.engine import RequestError
    from metainfer.engine.request import SamplingParams
    from metainfer.llm import LLM
    from metainfer.model.quant_config import CheckpointError

    texts = list(args.prompts) + list(args.prompt)
    if not texts and not args.prompt_token_ids:
        if sys.stdin is None or sys.stdin.isatty():
            print("error: no prompt: give one as an argument, with --prompt-token-ids, or on standard input",
                  file=sys.stderr)
            return 2
        texts = [sys.stdin.read()]
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if str(args.device).startswith("cuda") and not _cuda_available():
        print(f"error: --device {args.device}: no CUDA GPU is available here (use --device cpu)",
              file=sys.stderr)
        return 2
    try:
        llm = LLM(model=args.model, progress=not args.json, **engine_kwargs(args))
    except (FileNotFoundError, NotADirectoryError) as e:  # a model dir or file that is not there
        print(f"error: {e}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as e:
        print(f"error: a model file is not valid JSON: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # a checkpoint that cannot be loaded as asked
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        outs = llm.generate(texts or None, params, prompt_token_ids=args.prompt_token_ids or None)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for o in outs:
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt_token_ids": o.prompt_token_ids,
                        "token_ids": o.token_ids,
                        "text": o.text,
                        "finish_reason": o.finish_reason,
                    }
                )
            )
        else:
            prompt = llm.tokenizer.decode(o.prompt_token_ids)
            print(f"{prompt}\033[1m{o.text}\033[0m" if sys.stdout.isatty() else f"{prompt}{o.text}")
            print(f"[{len(o.token_ids)} tokens, finish_reason={o.finish_reason}]", file=sys.stderr)
    st = llm.engine.stats
    if args.speculative:
        print(f"[speculative: {st['spec_accepted']} of {st['spec_drafted']} drafts accepted over "
              f"{st['spec_verifies']} verifies; {st['steps']} steps]", file=sys.stderr)
    return 0
