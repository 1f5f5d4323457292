"""KB-0034's question on the H200: is a grid barrier inside one persistent launch cheaper than a
kernel boundary in a CUDA graph? A chain of S dependent GEMVs (experiments/grid_sync.py:
y[s + 1] = W[s] @ y[s], bf16 weights) run three ways, each captured in a CUDA graph and replayed:
one launch per stage with programmatic dependent launch off, with it on, and one persistent launch
with a grid barrier between stages (programs = the SM count, or one per row block; with and without
each program loading its first weight tile of the next stage before the barrier). Prints µs per
stage against the byte floor (the stage's weight bytes at 4.3 TB/s) and writes JSON.

  python experiments/barrier_bench.py --out $OUT        (~30 s on the H200)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' helpers
import grid_sync as gs  # noqa: E402  (experiments/grid_sync.py, beside this script)
from engine_smoke import env_info  # noqa: E402

from metainfer import settings  # noqa: E402
from metainfer.kernels import pdl  # noqa: E402

BW = 4.3e12  # bytes/s, the H200's measured copy bandwidth (docs/design.md §2)


def _time_graph(fn, reps: int) -> float:
    """Median µs of one replay of fn captured in a CUDA graph."""
    fn()  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _variant(w, y, counter, err, programs: int | None, block_n: int, prefetch: bool):
    if programs is None:
        return lambda: gs.chain_by_launches(w, y, block_n)
    kw = dict(programs=programs, block_n=block_n, prefetch=prefetch)
    return lambda: gs.chain_persistent(w, y, counter, err, **kw)


def run_case(S: int, N: int, reps: int, block_n: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(N)
    w = (torch.randn(S, N, N, device="cuda", generator=g) / N**0.5).to(torch.bfloat16)
    x = torch.randn(N, device="cuda", generator=g)
    want = gs.chain_by_launches(w, gs.chain_buffer(w, x), block_n)
    floor_us = N * N * 2 / BW * 1e6
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = -(-N // block_n)
    rows = []
    variants = [("launches, PDL off", "0", None, False), ("launches, PDL on", "1", None, False)]
    for p in sorted({sms, min(blocks, sms)}, reverse=True):
        variants += [(f"persistent, {p} programs", "1", p, False),
                     (f"persistent, {p} programs, next tile prefetched", "1", p, True)]
    for label, pdl_on, programs, prefetch in variants:
        with settings.override(pdl=pdl_on == "1"):  # METAINFER_PDL
            y = gs.chain_buffer(w, x)
            counter = torch.zeros(1, dtype=torch.int32, device="cuda")
            err = torch.zeros(1, dtype=torch.int32, device="cuda")
            fn = _variant(w, y, counter, err, programs, block_n, prefetch)
            us = _time_graph(fn, reps)
            y[1:] = float("nan")  # a last run from scratch: a stage reading before its input is written shows
            fn()
            torch.cuda.synchronize()
            ok = bool(torch.equal(y, want)) and int(err) == 0
            rows.append(dict(case=f"S={S} N={N}", variant=label, programs=programs, prefetch=prefetch,
                             pdl=pdl.enabled(), us_total=us, us_per_stage=us / S, floor_us_per_stage=floor_us,
                             pct_of_floor=100 * floor_us / (us / S), equal_to_launches=ok))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for S, N in ((40, 2048), (40, 256), (40, 4096)):  # 8 MB, 128 KB, 32 MB of weights per stage
        rows += run_case(S, N, args.reps, block_n=16)
    (out / "barrier_bench.json").write_text(json.dumps(dict(env=env_info(), rows=rows), indent=1))
    print("| case | variant | µs per stage | floor µs | % of floor | equal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['variant']} | {r['us_per_stage']:.2f} | {r['floor_us_per_stage']:.2f} | "
              f"{r['pct_of_floor']:.0f}% | {r['equal_to_launches']} |")


if __name__ == "__main__":
    main()
