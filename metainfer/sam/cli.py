"""`metainfer sam`: the SAM 3 image model — `verify` (the oracle) and `segment` (images × text prompts).

Exit codes: 0 success / pass, 1 verification failed, 2 usage error (bad flags, a missing or unreadable
image, an empty prompt, a model that cannot be loaded) reported as one `error:` line.
"""

from __future__ import annotations

import argparse
import json
import sys


def _model_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model and device")
    m.add_argument(
        "--model",
        default=None,
        help="checkpoint dir (transformers' Sam3Model layout), dummy (seeded weights of the released "
        "shape) or dummy:CONFIG_JSON (default: the embedded default model)",
    )
    m.add_argument("--device", default="auto", help="cpu | cuda | auto (cuda if a GPU is present)")
    m.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on cuda",
    )
    m.add_argument("--seed", type=int, default=0, metavar="N", help="seed of dummy weights and of the suite")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sam",
        help="SAM 3 image segmentation by text prompt: segment, verify",
        description="Sammie: SAM 3 image + text-prompt segmentation with our own model code.",
    )
    ss = p.add_subparsers(dest="sam_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])

    v = ss.add_parser(
        "verify",
        help="oracle: our model vs transformers' Sam3Model (fp32, TF32 off) on the same weights",
        description="Runs a seeded suite of synthetic images (odd sizes, 1 and several prompts, an "
        "empty-result prompt) through our model (batched and one by one) and through transformers' Sam3Model "
        "in fp32 on the same weights and preprocessed tensors; prints every check with its figure and gate. "
        "Exit 0: pass, 1: fail, 2: usage error.",
    )
    v.add_argument("--suite", default="auto", choices=["auto", "quick", "full"], help="auto: full on cuda")
    v.add_argument("--json", default=None, metavar="OUT", help="write the JSON verdict here (default: none)")
    v.add_argument(
        "--mutant",
        default=None,
        metavar="NAME",
        help="plant a known bug in our model first (the verdict must then be FAIL): skip_global_attention, "
        "drop_presence, wrong_query_masks, prompt_independent, cross_image_leak (default: none)",
    )
    _model_args(v)
    v.set_defaults(func=run_verify)

    s = ss.add_parser(
        "segment",
        help="segment images by text prompts: PNG overlays, --json boxes/scores/COCO RLE masks",
        description="Every instance of each prompt's concept: its mask, box and score. Writes one PNG "
        "overlay per image and prompt into --out; with --json prints one JSON document on stdout (masks as "
        "COCO RLE at the image's own size).",
    )
    s.add_argument(
        "--image",
        required=True,
        action="append",
        metavar="PATH",
        help="image file or directory; repeatable (no default: required)",
    )
    s.add_argument(
        "--prompt",
        required=True,
        action="append",
        metavar="TEXT",
        help="noun phrase; repeatable (no default: required)",
    )
    s.add_argument("--out", default="sam_out", metavar="DIR", help="directory for the PNG overlays")
    s.add_argument("--no-overlays", action="store_true", help="write no PNG files")
    s.add_argument("--json", action="store_true", help="print the detections as one JSON document on stdout")
    s.add_argument("--threshold", type=float, default=0.5, help="score threshold")
    s.add_argument("--mask-threshold", type=float, default=0.5, help="mask probability threshold")
    _model_args(s)
    s.set_defaults(func=run_segment)


def _device_dtype(args: argparse.Namespace) -> tuple[str, str]:
    import torch

    dev = args.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but no GPU is available")
    if dev != "cpu" and not dev.startswith("cuda"):
        raise ValueError(f"--device {dev!r}: expected cpu, cuda or auto")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if dev.startswith("cuda") else "float32")
    return dev, dtype


def _error(msg: object) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def run_verify(args: argparse.Namespace) -> int:
    from metainfer.sam.build import load
    from metainfer.sam.mutants import MUTANTS
    from metainfer.sam.oracle import GATES, build_suite, format_table, verify

    if args.mutant is not None and args.mutant not in MUTANTS:
        return _error(f"unknown mutant {args.mutant!r} (choose from {', '.join(MUTANTS)})")
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        return _error(f"verify needs transformers (pip install 'metainfer[oracle]'): {e}")
    try:
        dev, dtype = _device_dtype(args)
        loaded = load(args.model, dev, dtype, args.seed)
    except (ValueError, FileNotFoundError, OSError) as e:
        return _error(e)
    suite_name = args.suite if args.suite != "auto" else ("full" if dev.startswith("cuda") else "quick")
    suite = build_suite(suite_name, args.seed)
    model = loaded.model
    if args.mutant:
        model = MUTANTS[args.mutant](model)
    print(
        f"sam verify: model={loaded.name} device={dev} dtype={dtype} suite={suite_name} "
        f"({len(suite.cases)} images, {sum(len(c.prompts) for c in suite.cases)} prompts)"
        + (f" mutant={args.mutant}" if args.mutant else ""),
        file=sys.stderr,
    )
    print("gates: " + ", ".join(f"{k} {op} {g:g}" for k, (op, g) in GATES.items()), file=sys.stderr)
    from metainfer.sam.reference import Reference

    verdict = verify(
        model, loaded.tokenizer, suite, Reference(loaded.model), log=lambda m: print(m, file=sys.stderr)
    )
    verdict.context.update(model=loaded.name, device=dev, dtype=dtype, seed=args.seed, mutant=args.mutant)
    print(format_table(verdict))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(verdict.to_json(), f, indent=1)
    return 0 if verdict.passed else 1


def run_segment(args: argparse.Namespace) -> int:
    from pathlib import Path

    from metainfer.sam.build import load
    from metainfer.sam.processing import load_image
    from metainfer.sam.segment import detections_json, image_paths, save_overlay, segment, slug

    prompts = [p.strip() for p in args.prompt]
    if any(not p for p in prompts):
        return _error("empty prompt")
    if not (0.0 <= args.threshold < 1.0) or not (0.0 <= args.mask_threshold < 1.0):
        return _error("thresholds must lie in [0, 1)")
    try:
        paths = [p for arg in args.image for p in image_paths(arg)]
        images = [load_image(p) for p in paths]
        dev, dtype = _device_dtype(args)
        loaded = load(args.model, dev, dtype, args.seed)
        too_long = [
            p
            for p in prompts
            if len(loaded.tokenizer.encode([p])[1][0].nonzero()) >= loaded.tokenizer.context
        ]
        if too_long:
            print(
                f"warning: prompt cut to {loaded.tokenizer.context} tokens: {too_long[0]!r}", file=sys.stderr
            )
        results = segment(loaded, images, prompts, args.threshold, args.mask_threshold)
    except (ValueError, FileNotFoundError, OSError) as e:
        return _error(e)
    out = Path(args.out)
    if not args.no_overlays:
        out.mkdir(parents=True, exist_ok=True)
    doc = {
        "model": loaded.name,
        "threshold": args.threshold,
        "mask_threshold": args.mask_threshold,
        "images": [],
    }
    for path, img, dets in zip(paths, images, results):
        entry = {"image": str(path), "height": int(img.shape[0]), "width": int(img.shape[1]), "prompts": []}
        for prompt, det in zip(prompts, dets):
            entry["prompts"].append({"prompt": prompt, "detections": detections_json(det)})
            if not args.no_overlays:
                save_overlay(out / f"{path.stem}.{slug(prompt)}.png", img, det)
            if not args.json:
                scores = ", ".join(f"{s:.2f}" for s in det.scores.tolist())
                print(
                    f"{path}: {prompt!r}: {len(det.query)} instance(s)"
                    + (f" (scores {scores})" if scores else "")
                )
        doc["images"].append(entry)
    if args.json:
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
    elif not args.no_overlays:
        print(f"overlays in {out}/")
    return 0
