"""Kernel benchmark: routed experts (BF16 / FP8) and FP8 linears at the full Qwen3.6-35B-A3B shapes.

For every op and token count: checks the kernel against its reference on fresh random inputs,
then times it. "graph" = a CUDA graph of n back-to-back calls that rotate through n weight copies
(fp8_linear) or n routings (MoE), so weights come from HBM as in a decode step; reported per
call. "eager" = triton.testing.do_bench median of one plain call (includes launch overhead).
Bytes = weights actually read (the distinct experts each routing touches) + activations in/out.

    python benchmarks/kernels_b.py --out $OUT                # all ops, T = 1 ... 4096
    python benchmarks/kernels_b.py --ops moe --tokens 1,8,32 --sweep   # + tile-config search
    python benchmarks/kernels_b.py --ops fp8_linear --linears deltanet.out_proj --tokens 1,8,32 --sweep
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
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from metainfer.kernels import fp8_linear as fl
from metainfer.kernels import moe, routing
from metainfer.kernels import reference as ref
from metainfer.kernels import weight_stream as ws
from metainfer.kernels.ops import ref_dequant_fp8
from metainfer.model.fp8 import quantize_fp8_block

H, I, E, TOPK = 2048, 512, 256, 8
LINEARS = {"deltanet.in_proj": (12352, 2048), "deltanet.out_proj": (2048, 4096), "attn.qkv": (9216, 2048),
           "attn.o_proj": (2048, 4096), "shared.gate_up": (1024, 2048), "shared.down": (2048, 512)}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
BW = 4.3e12
ROTATE_BYTES = 256e6  # > 5x the H200's 50 MB L2


def rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def gap_kernel(x: torch.Tensor) -> None:
    """A small kernel between two weight-streaming launches (its output unused): the RMSNorm that
    precedes most projections in a decode step, so a kernel that preloads its weights before the
    PDL wait is timed with something to overlap, as in the engine."""
    from metainfer.kernels import norm

    norm.rms_norm(x, x[0], 1e-6)


def time_graph(fn, n: int) -> float:
    """µs per call of fn(i), i = 0..n-1, captured back to back in one CUDA graph."""
    for i in range(min(n, 2)):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fn(i)
    ms = triton.testing.do_bench(g.replay, warmup=5, rep=50, return_mode="median")
    del g
    return ms * 1e3 / n


def time_eager(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def row(op: str, T: int, us: float, eager_us: float | None, nbytes: float, flops: float,
        err: float | None) -> dict:
    gbs = nbytes / (us * 1e-6) / 1e9
    r = dict(op=op, T=T, us=round(us, 2), eager_us=None if eager_us is None else round(eager_us, 2),
             bytes=int(nbytes), GBps=round(gbs, 1), pct_bw=round(100 * gbs * 1e9 / BW, 1),
             TFLOPs=round(flops / (us * 1e-6) / 1e12, 2), rel_err=err)
    eager = f"{'-':>9s}" if eager_us is None else f"{eager_us:9.1f}"
    print(f"{op:34s} {T:5d} {us:9.1f} {eager} {nbytes / 1e6:10.2f} {gbs:8.0f} {r['pct_bw']:6.1f}% "
          f"{r['TFLOPs']:7.1f}  {'' if err is None else f'{err:.1e}'}", flush=True)
    return r


def header() -> None:
    print(f"{'op':34s} {'T':>5s} {'graph µs':>9s} {'eager µs':>9s} {'MB moved':>10s} {'GB/s':>8s} "
          f"{'%4.3TB/s':>7s} {'TFLOP/s':>7s}  rel_err", flush=True)


# ---- MoE -----------------------------------------------------------------------------------------
class MoeCase:
    """E routed experts, top-k; shared=True: the engine's fused layout (expert E is the shared one,
    every token's slot k, weight sigmoid of a logit: `ops.route_with_shared`)."""

    def __init__(self, fp8: bool, seed: int = 0, shared: bool = False) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        n = E + int(shared)
        w_gu = (torch.randn(n, 2 * I, H, device="cuda", generator=g) / H**0.5).bfloat16()
        w_dn = (torch.randn(n, H, I, device="cuda", generator=g) / I**0.5).bfloat16()
        self.fp8, self.shared = fp8, shared
        if fp8:
            self.w_gu, self.s_gu = quantize_fp8_block(w_gu)
            self.w_dn, self.s_dn = quantize_fp8_block(w_dn)
            self.ref_gu = ref_dequant_fp8(self.w_gu, self.s_gu, torch.bfloat16)
            self.ref_dn = ref_dequant_fp8(self.w_dn, self.s_dn, torch.bfloat16)
            del w_gu, w_dn
        else:
            self.w_gu, self.w_dn, self.s_gu, self.s_dn = w_gu, w_dn, None, None
            self.ref_gu, self.ref_dn = w_gu, w_dn
        elt = 1 if fp8 else 2
        self.expert_bytes = 3 * I * H * elt + (3 * I * H / 128**2 * 4 if fp8 else 0)

    def inputs(self, T: int, n: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
        g = torch.Generator(device="cuda").manual_seed(seed)
        out = []
        for _ in range(n):
            x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
            tw, ids = ref.route(torch.randn(T, E, device="cuda", generator=g) * 2, TOPK)
            if self.shared:
                sw = torch.randn(T, 1, device="cuda", generator=g).sigmoid()
                tw, ids = torch.cat([tw, sw], 1), torch.cat([ids, torch.full_like(ids[:, :1], E)], 1)
            out.append((x, tw.contiguous(), ids.contiguous()))
        return out

    def call(self, x, tw, ids, **kw) -> torch.Tensor:
        return moe.moe_experts(x, self.w_gu, self.w_dn, tw, ids, self.s_gu, self.s_dn, **kw)

    def run(self, T: int, path: str | None, config: dict | None = None, eager: bool = True) -> dict:
        n = max(1, min(64, math.ceil(ROTATE_BYTES / (self.expert_bytes * min(E, T * TOPK)))))
        ins = self.inputs(T, n, seed=T)
        x, tw, ids = ins[0]
        assert x.abs().sum() > 0
        want = ref.moe_experts(x, self.ref_gu, self.ref_dn, tw, ids)
        err = rel_rmse(self.call(x, tw, ids, path=path, config=config), want)
        us = time_graph(lambda i: self.call(*ins[i], path=path, config=config), n)
        eu = time_eager(lambda: self.call(x, tw, ids, path=path, config=config)) if eager else None
        distinct = sum(int(torch.unique(c[2]).numel()) for c in ins) / n
        nbytes = distinct * self.expert_bytes + 2 * T * H * 2 + T * TOPK * 12
        name = f"moe_{'fp8' if self.fp8 else 'bf16'}" + (f"[{path}]" if path else "")
        return row(name, T, us, eu, nbytes, 6.0 * T * TOPK * I * H, err)


def moe_sweep(case: MoeCase, T: int) -> dict:
    """Best tile config per path for one T (decode sizes)."""
    best = {}
    pair = [dict(BLOCK_I=bi, BLOCK_H=bh, BLOCK_K=128, STAGES=st, num_warps=w, DOWN="rows")
            for bi, bh, st, w in itertools.product((8, 16, 32), (8, 16, 32), (2, 4), (2, 4))]
    grouped = [dict(BLOCK_M=16, GU_BLOCK_N=gn, DN_BLOCK_N=dn, BLOCK_K=bk, num_warps=4, num_stages=3)
               for gn, dn, bk in itertools.product((32, 64, 128), (64, 128), (64, 128))]
    for path, cfgs in (("pair", pair if T <= 32 else []), ("grouped", grouped)):
        results = []
        for cfg in cfgs:
            try:
                results.append((case.run(T, path, cfg, eager=False)["us"], cfg))
            except Exception as e:  # a config the compiler rejects (shared memory, registers)
                print(f"  skip {cfg}: {type(e).__name__}")
        if results:
            us, cfg = min(results, key=lambda r: r[0])
            best[path] = dict(us=us, config=cfg)
            print(f"  best {path} T={T}: {us:.1f} µs {cfg}", flush=True)
    return best


# ---- FP8 linear ----------------------------------------------------------------------------------
class LinearCase:
    def __init__(self, name: str, N: int, K: int) -> None:
        self.name, self.N, self.K = name, N, K
        self.wbytes = N * K + math.ceil(N / 128) * math.ceil(K / 128) * 4
        self.copies = max(1, min(256, math.ceil(ROTATE_BYTES / self.wbytes)))
        w = torch.randn(N, K, device="cuda") / K**0.5
        q, s = quantize_fp8_block(w)
        self.q = [q] + [q.clone() for _ in range(self.copies - 1)]
        self.s = [s] + [s.clone() for _ in range(self.copies - 1)]
        self.w_bf16 = ref_dequant_fp8(q, s, torch.bfloat16)
        self.w_bf16_copies = [self.w_bf16] + [self.w_bf16.clone() for _ in range(min(self.copies, 128) - 1)]

    def run(self, T: int, backend: str = "triton", cfg: dict | None = None, eager: bool = True,
            gap: bool = False) -> dict:
        """gap: an RMSNorm launch before each projection (`gap_kernel`), as in the decode step."""
        x = [torch.randn(T, self.K, device="cuda").bfloat16() for _ in range(min(self.copies, 8))]
        n = self.copies if T <= 256 else min(self.copies, 4)
        flops = 2.0 * T * self.N * self.K
        act = T * (self.K + self.N) * 2
        if backend == "bf16":
            nb = len(self.w_bf16_copies)
            us = time_graph(lambda i: F.linear(x[i % len(x)], self.w_bf16_copies[i % nb]), min(n, nb))
            return row(f"bf16_linear[{self.name}]", T, us, None, self.N * self.K * 2 + act, flops, None)
        use_cublas = fl._use_cublas  # the W8A8 GEMM's backend: the one asked for, then the engine's again
        fl._use_cublas = lambda: backend == "cublas"
        try:
            def call(i):
                if gap:
                    gap_kernel(x[i % len(x)])
                if cfg is None:
                    return fl.fp8_linear(x[i % len(x)], self.q[i], self.s[i])
                y = torch.empty(T, self.N, dtype=torch.bfloat16, device="cuda")
                ws.stream_linear(x[i % len(x)], self.q[i], self.s[i], y, cfg)
                return y

            want = F.linear(x[0], self.w_bf16)
            err = rel_rmse(call(0), want)
            us = time_graph(call, n)
            eu = time_eager(lambda: call(0)) if eager else None
        finally:
            fl._use_cublas = use_cublas
        tag = "" if backend == "triton" else f"/{backend}"
        return row(f"fp8_linear{tag}[{self.name}]", T, us, eu, self.wbytes + act, flops, err)


def skinny_sweep(case: LinearCase, T: int) -> dict:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for bn, bk, mult, w, st in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4), (4,), (3, 5)):
        if T > 1 and bk > 256:
            continue
        cfg = ws.skinny_config(T, case.N, case.K, sms)
        tiles, k_iters = triton.cdiv(case.N, bn), triton.cdiv(case.K, bk)
        split = max(1, min(k_iters, mult * sms // tiles))
        per = triton.cdiv(k_iters, split)
        cfg.update(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=triton.cdiv(k_iters, per), iters_per_split=per,
                   num_warps=w, STAGES=st)
        try:
            results.append((case.run(T, cfg=cfg, eager=False)["us"], cfg))
        except Exception as e:
            print(f"  skip {cfg}: {type(e).__name__}")
    us, cfg = min(results, key=lambda r: r[0])
    print(f"  best skinny {case.name} T={T}: {us:.1f} µs {cfg}", flush=True)
    return dict(us=us, config=cfg)


# ---- main ----------------------------------------------------------------------------------------
def meta(args) -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, check=True).stdout.strip()
        except Exception:
            return None

    p = torch.cuda.get_device_properties(0)
    return dict(gpu=p.name, sms=p.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), commit=git("rev-parse", "HEAD"),
                dirty=bool(git("status", "--porcelain")),
                date=datetime.now(UTC).isoformat(),
                command=" ".join(["python", "benchmarks/kernels_b.py", *args.argv]),
                bandwidth=BW)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--ops", default="moe,route,fp8_linear", help="comma list: moe, route, fp8_linear")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--linears", default=",".join(LINEARS))
    ap.add_argument("--sweep", action="store_true", help="tile-config search at decode sizes (slow)")
    args = ap.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.manual_seed(0)
    ops, tokens = args.ops.split(","), [int(t) for t in args.tokens.split(",")]
    result: dict = dict(meta=meta(args), rows=[], sweep={})
    print(json.dumps(result["meta"]))
    header()
    if "moe" in ops:
        for fp8 in (False, True):
            case = MoeCase(fp8)
            for T in tokens:
                result["rows"].append(case.run(T, None))
                if T <= 32:
                    for path in ("pair", "grouped"):
                        result["rows"].append(case.run(T, path, eager=False))
                if args.sweep and T in (1, 8, 32):
                    result["sweep"][f"moe_{'fp8' if fp8 else 'bf16'}_T{T}"] = moe_sweep(case, T)
            del case
            torch.cuda.empty_cache()
    if "route" in ops:
        for T in tokens:
            logits = [torch.randn(T, E + 1, device="cuda").bfloat16()[:, :E] for _ in range(8)]
            w, ids = routing.route_topk(logits[0], TOPK)
            err = rel_rmse(w, ref.route(logits[0], TOPK)[0])
            for name, fn in (("route_topk", routing.route_topk), ("route[torch]", ref.route)):
                us = time_graph(lambda i, fn=fn, lg=logits: fn(lg[i], TOPK), 8)
                result["rows"].append(row(name, T, us, None, T * E * 2 + T * TOPK * 16, 0.0, err))
    if "fp8_linear" in ops:
        for name in args.linears.split(","):
            case = LinearCase(name, *LINEARS[name])
            for T in tokens:
                result["rows"].append(case.run(T))
                result["rows"].append(case.run(T, backend="bf16"))
                if T > ws.SKINNY_MAX_T:
                    try:
                        result["rows"].append(case.run(T, backend="cublas"))
                    except Exception as e:  # torch without the blockwise recipe
                        print(f"  cublas blockwise unavailable: {type(e).__name__}: {str(e)[:200]}")
                if args.sweep and T in (1, 8, 32):
                    result["sweep"][f"skinny_{name}_T{T}"] = skinny_sweep(case, T)
            del case
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kernels_b.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
