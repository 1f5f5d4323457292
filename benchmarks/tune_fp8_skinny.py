"""Sweeps the FP8 weight-streaming (decode) linear kernel's tiles for the model's dense shapes and
writes the best config per (N, K, T) as JSON, the format `fp8_linear.tuned_table` reads.

    python benchmarks/tune_fp8_skinny.py --tokens 1 --out $OUT
    METAINFER_FP8_TUNED=$OUT/fp8_skinny_tuned.json python benchmarks/decode_bench.py --dtype fp8
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_b import LINEARS, LinearCase  # noqa: E402

from metainfer.kernels import weight_stream as ws  # noqa: E402


def sweep(case: LinearCase, T: int, sms: int) -> tuple[float, float, dict]:
    base_cfg = ws.skinny_config(T, case.N, case.K, sms)
    base = case.run(T, cfg=base_cfg, eager=False)["us"]
    best = (base, base_cfg)
    for bn, bk, mult in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4)):
        if T > 1 and bk > 256:
            continue
        tiles, k_iters = triton.cdiv(case.N, bn), triton.cdiv(case.K, bk)
        per = triton.cdiv(k_iters, max(1, min(k_iters, mult * sms // tiles)))
        cfg = dict(base_cfg, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=triton.cdiv(k_iters, per), iters_per_split=per)
        try:
            us = case.run(T, cfg=cfg, eager=False)["us"]
        except Exception as e:  # a config the compiler rejects
            print(f"  skip {cfg}: {type(e).__name__}", flush=True)
            continue
        if us < best[0]:
            best = (us, cfg)
    return base, best[0], best[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--linears", default="deltanet.in_proj,deltanet.out_proj,attn.qkv")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs, rows = {}, []
    for name in args.linears.split(","):
        N, K = LINEARS[name]
        case = LinearCase(name, N, K)
        for T in map(int, args.tokens.split(",")):
            base, us, cfg = sweep(case, T, sms)
            configs[f"{N},{K},{T}"] = cfg
            rows.append(
                dict(
                    linear=name, N=N, K=K, T=T, default_us=base, tuned_us=us, tuned_gbs=case.wbytes / us / 1e3
                )
            )
            print(
                f"{name} T={T}: default {base:.1f} us -> tuned {us:.1f} us "
                f"({case.wbytes / us / 1e3:.0f} GB/s) {cfg}",
                flush=True,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = dict(
        gpu=torch.cuda.get_device_name(),
        triton=triton.__version__,
        date=datetime.now(UTC).isoformat(),
        rows=rows,
        configs=configs,
    )
    (out / "fp8_skinny_tuned.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
