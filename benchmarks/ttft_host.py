"""Where the idle 1k-prompt TTFT goes on the host: TTFT before and after a decode run, the forward's
enqueue time against its synchronised time, and a cProfile of one request (top functions by own
time). Full config, dummy weights.

    python benchmarks/ttft_host.py --dtype fp8 --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import decode_run, random_prompts  # noqa: E402

from metainfer.config import FULL_CONFIG  # noqa: E402
from metainfer.engine.request import SamplingParams  # noqa: E402
from metainfer.llm import LLM  # noqa: E402


def ttfts(llm: LLM, n: int, seed: int, prompt_len: int) -> list[float]:
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = []
    for p in random_prompts(n, prompt_len, seed):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=[p], sampling_params=sp)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp8", choices=["bfloat16", "fp8"])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    llm = LLM(
        model=f"dummy:{FULL_CONFIG}",
        device="cuda",
        dtype="bfloat16",
        quantization="fp8" if args.dtype == "fp8" else None,
        max_model_len=args.prompt_len + 96,
        max_num_seqs=128,
        max_num_batched_tokens=8192,
    )
    res: dict = {"dtype": args.dtype}
    res["ttft_fresh_ms"] = ttfts(llm, 6, 99, args.prompt_len)[1:]
    # the forward alone: enqueue time (host) and synchronised time
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prof = cProfile.Profile()
    p = random_prompts(1, args.prompt_len, 7)[0]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(prompt_token_ids=[p], sampling_params=sp)
    prof.disable()
    res["ttft_cprofile_ms"] = (time.perf_counter() - t0) * 1e3
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28)
    res["cprofile_tottime"] = s.getvalue()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
    res["cprofile_cumulative"] = s.getvalue()
    decode_run(llm, 1, args.prompt_len, 32, seed=1)
    res["ttft_after_decode_ms"] = ttfts(llm, 5, 98, args.prompt_len)
    decode_run(llm, 64, args.prompt_len, 16, seed=2)
    res["ttft_after_b64_ms"] = ttfts(llm, 5, 97, args.prompt_len)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"ttft_host_{args.dtype}.json").write_text(json.dumps(res, indent=1))
    print(res["cprofile_tottime"][-6000:])
    print(res["cprofile_cumulative"][-7000:])
    for k in ("ttft_fresh_ms", "ttft_after_decode_ms", "ttft_after_b64_ms"):
        print(f"{args.dtype} {k}: median {statistics.median(res[k]):.1f} all {[round(x, 1) for x in res[k]]}")
    print(f"{args.dtype} ttft under cProfile: {res['ttft_cprofile_ms']:.1f} ms")


if __name__ == "__main__":
    main()
