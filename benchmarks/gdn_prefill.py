"""Benchmark of the chunked gated-delta-rule prefill kernels (metainfer/kernels/gdn_prefill.py) at the
full Qwen3.6-35B-A3B DeltaNet shapes (Hk 16, Dk 128, Hv 32, Dv 128, bf16 inputs), one layer.

Each case builds fresh random inputs (q, k, v strided views of a fused projection; Qwen3.5-style
gating; a non-zero initial state), checks the kernel against the fp32 torch reference
(`gated_delta_rule_chunked`: relative RMSE of out and of the final state), then times it with
triton.testing.do_bench (median, L2 flushed before each call, launch overhead included), splits the
time into the prep and scan kernels with torch.profiler, and optionally times the reference.
  - TFLOP/s: nominal FLOPs of the chunked algorithm (each dot once; bf16x3 executes 3 MMAs);
  - GB/s: the bytes a perfect kernel must move (q, k, v, g, beta, out, state read + write);
  - ws_MB: the workspace the prep kernel writes and the scan kernel reads (default precisions).

    python benchmarks/gdn_prefill.py                 # check + time, table, JSON in --out ($OUT or ./out)
    python benchmarks/gdn_prefill.py --sweep         # also one-knob-at-a-time config sweep at L=1024
    python benchmarks/gdn_prefill.py --grid "sub_block=2,4;prep_warps=4,8"  # also every combination
    python benchmarks/gdn_prefill.py --ref           # also time the torch reference
    python benchmarks/gdn_prefill.py --dry-run       # CPU, TRITON_INTERPRET, tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter is chosen when triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from metainfer.kernels import gdn_prefill as gp  # noqa: E402
from metainfer.kernels import reference as ref  # noqa: E402

DRY = "--dry-run" in sys.argv
DEV = "cpu" if DRY else "cuda"
HK, DK, HV, DV = (2, 16, 4, 16) if DRY else (16, 128, 32, 128)
OUT_TOL, STATE_TOL = 1e-2, 1e-3
SWEEP = {
    "block_v": [16, 32, 64],
    "sub_block": [1, 2, 4, 8, 16, 32, 64],  # 1: the inverse by block doubling only (log2 64 = 6 products)
    "prep_warps": [4, 8],
    "scan_warps": [4, 8],
    "scan_stages": [1, 2, 3],
    "state_prec": ["bf16x3", "tf32x3", "tf32"],
}


def rel_rmse(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def inputs(T: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    C = 2 * HK * DK + HV * DV
    mixed = torch.randn(T, C + 2 * HV * DV, device=DEV, generator=g).bfloat16()[:, :C]
    q, k, v = torch.split(mixed, [HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.view(T, HK, DK), k.view(T, HK, DK), v.view(T, HV, DV)
    ab = torch.randn(T, 2 * HV + 8, device=DEV, generator=g).bfloat16()
    A_log = torch.empty(HV, device=DEV).uniform_(1, 16, generator=g).log()
    dt = torch.empty(HV, device=DEV).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp()
    gate = -A_log.exp() * F.softplus(ab[:, :HV].float() + dt + torch.log(-torch.expm1(-dt)))
    return q, k, v, gate, ab[:, HV : 2 * HV].sigmoid()


def nominal(lens: list[int], cfg: gp.PrefillConfig) -> tuple[int, int, int]:
    """-> (FLOPs, bytes a perfect kernel moves, workspace bytes at the default precisions)."""
    C, nb = gp.CHUNK, gp.CHUNK // cfg.sub_block
    chunks = sum(triton.cdiv(n, C) for n in lens)
    macs = C * C * (3 * DK + DV) + 2 * int(math.log2(nb)) * C**3 + C * (3 * DK * DV + C * DV)
    T = sum(lens)
    io = T * (2 * HK * DK * 2 + HV * DV * 2 * 2 + HV * 6) + len(lens) * 2 * HV * DK * DV * 4
    ws = T * HV * (2 * DK * 4 + DV * 4 + DK * 2 + C * 2 + 4)  # w, ke hi/lo; u; qe, a bf16; c
    return 2 * macs * chunks * HV, io, ws


def kernel_split(fn, iters: int = 10) -> dict[str, float]:
    """Mean device time per call (us) of each Triton kernel that fn launches."""
    if DRY:
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if "_prep_kernel" in ev.key or "_scan_kernel" in ev.key:
            name = "prep_us" if "_prep_kernel" in ev.key else "scan_us"
            total = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
            out[name] = total / iters
    return out


def bench(fn) -> float:
    if DRY:
        fn()
        return float("nan")
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def run_case(lens: list[int], cfg: gp.PrefillConfig, with_ref: bool, seed: int = 0) -> dict:
    T = sum(lens)
    q, k, v, g, beta = inputs(T, seed)
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    N = len(lens)
    ssm = 0.5 * torch.randn(N + 1, HV, DK, DV, device=DEV, generator=gen)
    cu_list = [0]
    for n in lens:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=DEV)
    slots = torch.arange(1, N + 1, device=DEV)
    has = torch.ones(N, dtype=torch.bool, device=DEV)
    res: dict = {"shape": "x".join(map(str, lens)) if N > 1 else str(lens[0]), "config": asdict(cfg)}
    try:
        if N == 1:
            init = ssm[1]

            def fn():
                return gp.gdn_prefill(q, k, v, g, beta, init, cfg=cfg)

            out, state = fn()
            states = state[None]
        else:
            work = ssm.clone()

            def fn():
                return gp.gdn_prefill_varlen(q, k, v, g, beta, cu, work, slots, has, max(lens), cfg=cfg)

            out = fn()
            states = work[1:].clone()
            work.copy_(ssm)
    except Exception as e:  # out of resources (shared memory) for some sweep configs
        return {**res, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    o_err, s_err, ref_fns = 0.0, 0.0, []
    for i in range(N):
        s, e = cu_list[i], cu_list[i + 1]
        args = (q[s:e], k[s:e], v[s:e].float(), g[s:e], beta[s:e].float(), ssm[i + 1])
        want, want_state = ref.gated_delta_rule_chunked(*args)
        o_err = max(o_err, rel_rmse(out[s:e], want))
        s_err = max(s_err, rel_rmse(states[i], want_state))
        ref_fns.append(lambda args=args: ref.gated_delta_rule_chunked(*args))
    flops, io, ws = nominal(lens, cfg)
    us = bench(fn)
    res.update(
        us=us, tflops=flops / us * 1e-6, gbps=io / us * 1e-3, ws_mb=ws / 1e6,
        out_rel_rmse=o_err, state_rel_rmse=s_err, ok=o_err < OUT_TOL and s_err < STATE_TOL,
        **kernel_split(fn),
    )
    if with_ref:
        res["ref_us"] = bench(lambda: [f() for f in ref_fns])
    return res


def env_info() -> dict:
    info = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "python": platform.python_version(),
        "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
    }
    try:
        git = lambda *c: subprocess.run(["git", *c], capture_output=True, text=True).stdout.strip()  # noqa: E731
        sha, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain")
        info["git"] = sha + ("+dirty" if dirty else "")
    except OSError:
        pass
    return info


def table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    cols = ["shape", "us", "prep_us", "scan_us", "ref_us", "tflops", "gbps", "ws_mb", "out_rel_rmse",
            "state_rel_rmse", "ok"]
    print(" ".join(f"{c:>14s}" for c in cols) + "  config")
    for r in rows:
        cells = []
        for c in cols:
            val = r.get(c, "")
            cells.append(f"{val:>14.4g}" if isinstance(val, float) else f"{val!s:>14s}")
        print(" ".join(cells) + "  " + (r.get("tag", "") or r.get("error", "")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="directory for the JSON result")
    p.add_argument("--lengths", default="256,1024,4096", help="single-sequence lengths")
    p.add_argument("--varlen", default="1024,1024,1024,1024", help="one varlen case ('' for none)")
    p.add_argument("--sweep", action="store_true", help="one-knob-at-a-time config sweep at L=1024")
    p.add_argument("--grid", action="append", default=[],
                   help='knob=v1,v2;knob=... : every combination at L=1024 (repeatable)')
    p.add_argument("--ref", action="store_true", help="also time the torch reference")
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    a = p.parse_args()
    if not DRY and not torch.cuda.is_available():
        print("needs CUDA (or --dry-run)", file=sys.stderr)
        return 2
    lengths = [5, 70] if DRY else [int(x) for x in a.lengths.split(",") if x]
    cases = [[n] for n in lengths]
    if a.varlen:
        cases.append([3, 65, 1] if DRY else [int(x) for x in a.varlen.split(",")])
    rows = [run_case(lens, gp.CONFIG, a.ref) for lens in cases]
    table(rows, f"gdn_prefill, one layer (Hk {HK}, Dk {DK}, Hv {HV}, Dv {DV}), config {asdict(gp.CONFIG)}")
    one_k = next((r for r in rows if r.get("shape") == "1024"), None)
    if one_k and "us" in one_k:
        print(f"\n30 DeltaNet layers at L=1024: {30 * one_k['us'] / 1e3:.3f} ms")
    sweep = []
    if a.sweep:
        L = [70] if DRY else [1024]
        for knob, values in SWEEP.items():
            for val in values:
                if getattr(gp.CONFIG, knob) == val:
                    continue
                cfg = replace(gp.CONFIG, **{knob: val})
                sweep.append({**run_case(L, cfg, False), "tag": f"{knob}={val}"})
        table(sweep, f"sweep at L={L[0]} (one knob changed from the default)")
    for grid in a.grid:
        L = [70] if DRY else [1024]
        knobs = [kv.split("=") for kv in grid.split(";") if kv]
        axes = [[(k, type(getattr(gp.CONFIG, k))(v)) for v in vals.split(",")] for k, vals in knobs]
        for combo in itertools.product(*axes):
            cfg = replace(gp.CONFIG, **dict(combo))
            sweep.append({**run_case(L, cfg, False), "tag": " ".join(f"{k}={v}" for k, v in combo)})
        table(sweep[-math.prod(len(ax) for ax in axes):], f"grid at L={L[0]}")
    good = [r for r in sweep if r.get("ok")]
    if good:
        best = min(good, key=lambda r: r["us"])
        print(f"\nfastest passing variant: {best['tag']} {best['us']:.1f} us")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gdn_prefill_{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps({"env": env_info(), "results": rows, "sweep": sweep}, indent=1, default=str))
    print(f"\nwrote {path}")
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
