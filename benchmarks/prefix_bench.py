"""Prefix caching on a multi-turn workload (full config, dummy weights, random token ids): C conversations
share an S-token system prompt; each turn appends U new user tokens to the conversation so far (its
earlier prompts and greedy replies) and generates G tokens. Per turn, all C conversations run as one
continuous batch (mean and max TTFT, output tok/s), then conversation 0's next-turn prompt alone on the
idle engine (its TTFT: a hit on the previous turns when prefix caching is on).

Run it twice, with and without prefix caching, and compare (one process each: one model on the GPU):
    python benchmarks/prefix_bench.py --dtype fp8 --out $OUT
    python benchmarks/prefix_bench.py --dtype fp8 --no-prefix-caching --out $OUT
Writes prefix_bench_{on,off}.json (per turn: batch wall time, TTFTs, output tok/s, lone TTFT, the
engine's prefix-cache counters) and the greedy tokens' fingerprint (must match between on and off).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import random_prompts  # noqa: E402
from engine_smoke import env_info  # noqa: E402

from metainfer.engine.request import SamplingParams  # noqa: E402
from metainfer.llm import LLM  # noqa: E402

FULL_CONFIG = Path(__file__).resolve().parents[1] / "metainfer/configs/qwen3.6-35b-a3b.json"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(FULL_CONFIG))
    ap.add_argument("--dtype", choices=("bfloat16", "fp8"), default="fp8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--system", type=int, default=8192, help="shared system prompt tokens (S)")
    ap.add_argument("--user", type=int, default=256, help="new user tokens a turn (U)")
    ap.add_argument("--gen", type=int, default=256, help="generated tokens a turn (G)")
    ap.add_argument("--conversations", type=int, default=16, help="conversations at once (C)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    on = not args.no_prefix_caching
    S, U, G, C, turns = args.system, args.user, args.gen, args.conversations, args.turns
    max_len = S + turns * (U + G) + U + 64
    llm = LLM(
        model=f"dummy:{args.config}", device=args.device, dtype="bfloat16",
        quantization="fp8" if args.dtype == "fp8" else None, max_model_len=max_len,
        max_num_seqs=C, enable_prefix_caching=on,
    )
    vocab = min(248000, llm.engine.model_config.vocab_size)
    system = random_prompts(1, S, seed=1, vocab=vocab)[0]
    users = [random_prompts(C, U, seed=100 + t, vocab=vocab) for t in range(turns + 1)]
    history = [list(system) for _ in range(C)]
    sp = SamplingParams(max_tokens=G, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    digest = hashlib.sha1()
    rows = []
    for t in range(turns):
        prompts = [h + users[t][c] for c, h in enumerate(history)]
        stats0 = dict(llm.engine.stats)
        sync(args.device)
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        sync(args.device)
        wall = time.perf_counter() - t0
        ttfts = [o.ttft * 1e3 for o in outs if o.ttft is not None]
        for c, o in enumerate(outs):
            history[c] = prompts[c] + list(o.token_ids)
            digest.update(json.dumps(o.token_ids).encode())
        stats1 = dict(llm.engine.stats)
        # conversation 0's next prompt alone on the idle engine, one token (a hit on this turn's blocks)
        lone = history[0] + users[t + 1][0]
        sync(args.device)
        t1 = time.perf_counter()
        llm.generate(prompt_token_ids=[lone], sampling_params=one)
        sync(args.device)
        lone_ms = (time.perf_counter() - t1) * 1e3
        row = {
            "turn": t + 1,
            "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
            "batch_wall_s": round(wall, 4),
            "output_tok_s": round(C * G / wall, 1),
            "ttft_ms_mean": round(statistics.mean(ttfts), 2) if ttfts else None,
            "ttft_ms_max": round(max(ttfts), 2) if ttfts else None,
            "lone_next_prompt_tokens": len(lone),
            "lone_next_ttft_ms": round(lone_ms, 2),
            **{k: stats1.get(k, 0) - stats0.get(k, 0) for k in ("prefix_cache_queries", "prefix_cache_hits")},
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    res = {"env": env_info(), "dtype": args.dtype, "prefix_caching": on, "S": S, "U": U, "G": G, "C": C,
           "turns": rows, "tokens_sha1": digest.hexdigest()[:12]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"prefix_bench_{'on' if on else 'off'}.json").write_text(json.dumps(res, indent=1))
    print(f"prefix caching {'on' if on else 'off'}: tokens sha1 {res['tokens_sha1']}", flush=True)


if __name__ == "__main__":
    main()
