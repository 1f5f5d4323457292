"""loop.toml's text for `metainfer loop init`: the defaults of a target and device, rendered with comments."""

from __future__ import annotations

import json
from typing import Any

from metainfer.loop.config import TARGETS, ConfigError


def _q(v: Any) -> str:
    """A TOML value: JSON's strings, numbers, booleans and arrays are TOML's too."""
    return json.dumps(v)


def defaults(target: str, device: str, model: str | None, dtype: str | None, gpu: str | None) -> dict:
    """loop.toml's tables for a target and device: the embedded default model on a CPU, the full
    config's dummy weights in FP8 on a GPU."""
    if target not in TARGETS:
        raise ConfigError(f"target must be one of {', '.join(TARGETS)}")
    cuda = device.startswith("cuda")
    py = "{python}"
    if target == "qwen":
        model = (
            model if model is not None else ("dummy:metainfer/configs/qwen3.6-35b-a3b.json" if cuda else "")
        )
        dtype = dtype or ("fp8" if cuda else "float32")
        engine = ["--model", "{model}", "--dtype", "{dtype}", "--device", "{device}"]
        oracle = [
            py,
            "-m",
            "metainfer.cli",
            "verify",
            "--suite",
            "full" if cuda else "quick",
            *engine,
            "--json",
            "{out}",
        ]
        offline = [py, "-m", "metainfer.cli", "bench", "offline", *engine]
        if cuda:
            workloads = [
                {
                    "name": "c1",
                    "command": [
                        *offline,
                        "--input-len",
                        "1024",
                        "--output-len",
                        "256",
                        "--batch-size",
                        "1",
                        "--json",
                        "{out}",
                    ],
                },
                {
                    "name": "c32",
                    "command": [
                        *offline,
                        "--input-len",
                        "1024",
                        "--output-len",
                        "256",
                        "--batch-size",
                        "32",
                        "--json",
                        "{out}",
                    ],
                },
            ]
            metrics = [
                {
                    "name": "decode_c1_tok_s",
                    "workload": "c1",
                    "key": "metrics.decode_tok_s",
                    "better": "higher",
                    "target": 1000.0,
                    "tolerance": 0.02,
                },
                {
                    "name": "ttft_1k_ms",
                    "workload": "c1",
                    "key": "metrics.mean_ttft_ms",
                    "better": "lower",
                    "target": 15.0,
                    "tolerance": 0.05,
                },
                {
                    "name": "c32_out_tok_s",
                    "workload": "c32",
                    "key": "metrics.output_throughput",
                    "better": "higher",
                    "target": 4500.0,
                    "tolerance": 0.03,
                },
            ]
        else:
            workloads = [
                {
                    "name": "offline",
                    "command": [
                        *offline,
                        "--input-len",
                        "16",
                        "--output-len",
                        "32",
                        "--num-iters",
                        "3",
                        "--json",
                        "{out}",
                    ],
                }
            ]
            metrics = [
                {
                    "name": "decode_tok_s",
                    "workload": "offline",
                    "key": "metrics.decode_tok_s",
                    "better": "higher",
                    "tolerance": 0.10,
                },
                {
                    "name": "ttft_ms",
                    "workload": "offline",
                    "key": "metrics.mean_ttft_ms",
                    "better": "lower",
                    "tolerance": 0.50,
                },
            ]
        tests = [py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_default_model.py"]
    else:
        model = model or ""
        dtype = dtype or ("bfloat16" if cuda else "float32")
        engine = ["--model", "{model}", "--dtype", "{dtype}", "--device", "{device}"]
        oracle = [
            py,
            "-m",
            "metainfer.cli",
            "sam",
            "verify",
            "--suite",
            "full" if cuda else "quick",
            *engine,
            "--json",
            "{out}",
        ]
        # the Sammie benchmark's command and its images/s key: edit to match `metainfer sam bench`
        workloads = [
            {
                "name": "images",
                "command": [py, "-m", "metainfer.cli", "sam", "bench", *engine, "--json", "{out}"],
            }
        ]
        metrics = [
            {
                "name": "sam_img_s",
                "workload": "images",
                "key": "metrics.images_per_s",
                "better": "higher",
                "target": 100.0 if cuda else None,
                "tolerance": 0.03,
            }
        ]
        tests = [py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/sam"]
    return {
        "boundary": {
            "target": target,
            "model": model,
            "dtype": dtype,
            "device": "cuda" if cuda else "cpu",
            "gpu": gpu or ("H200" if cuda else "cpu"),
            "traffic": "decode",
        },
        "goal": {"primary": metrics[0]["name"], "min_gain": 0.01 if cuda else 0.05, "metrics": metrics},
        "oracle": {"command": oracle, "timeout_minutes": 60 if cuda else 10},
        "tests": {"command": tests, "timeout_minutes": 15},
        "bench": {"rounds": 3, "workloads": workloads},
        "judge": {"protected": [], "forbidden": []},
        "agent": {"command": "", "timeout_minutes": 60, "profile_command": []},
        "budget": {"iterations": 20, "wall_minutes": 1440, "device_minutes": 480},
        "paths": {"kb_dir": "", "run_dir": ".loop", "ratchet": "loop/ratchet"},
    }


COMMENTS = {
    "boundary": "what is fixed: the target, the model ('' = the embedded default model; dummy:CONFIG; an HF "
    "dir), the precision, the device, and the GPU the figures hold for",
    "goal": "the primary metric must improve beyond the A/B noise band (and at least min_gain, relative); "
    "no other metric may worsen by more than its tolerance; a run stops once every target is met",
    "oracle": "run on the candidate's engine with the base revision's oracle; must exit 0 and write "
    '{"passed": true} to {out}',
    "tests": "the candidate's CPU tests (short); placeholders: {python} {out} {model} {dtype} {device}",
    "bench": "each workload runs in a fresh process per side and round, base and candidate alternating; "
    "a metric's key is a dotted path into its workload's JSON",
    "judge": "paths a candidate may not touch, beyond metainfer loop's own list (oracle, bench, loop, kb, "
    "tests, loop.toml ...); regexes its added lines may not match",
    "agent": "CMD runs in a fresh worktree at the ratchet's head with the brief's path as its last argument "
    "(or in place of {brief}) and in $LOOP_BRIEF",
    "budget": "a run stops at the first budget spent (device minutes: the judge's commands' time)",
    "paths": "kb_dir '' = the repository's metainfer/kb/records; run_dir holds worktrees, briefs, verdicts",
}


def render(tables: dict) -> str:
    """loop.toml's text for `tables` (the shape `defaults` returns), commented."""
    lines = ["# metainfer loop: the boundary, the goal, the judge and the budgets (docs/loop.md)", ""]
    for name, body in tables.items():
        lines.append(f"# {COMMENTS[name]}")
        lines.append(f"[{name}]")
        arrays = {k: v for k, v in body.items() if isinstance(v, list) and v and isinstance(v[0], dict)}
        for k, v in body.items():
            if k not in arrays and v is not None:
                lines.append(f"{k} = {_q(v)}")
        lines.append("")
        for k, items in arrays.items():
            for item in items:
                lines.append(f"[[{name}.{k}]]")
                lines += [f"{ik} = {_q(iv)}" for ik, iv in item.items() if iv is not None]
                lines.append("")
    return "\n".join(lines)
