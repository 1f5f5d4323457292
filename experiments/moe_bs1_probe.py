"""Batch-1 routed experts on the H200: how far the two FP8 MoE kernels are from a plain read of the
same bytes, and what the in-kernel routing and the tiles cost.

The batch-1 profile (results/2026-12-01d) has `_pair_gate_up_kernel` at 11.2 µs per layer (39 % of
its bandwidth floor: 9 experts x 2 MiB of e4m3) and `_routed_down_kernel` at 6.1 µs (36 %). This
probe times, each as CUDA-graph replays of back-to-back calls over rotating weights (so the bytes
come from HBM), with an RMSNorm launch between calls as in the step (the PDL overlap):

  stream   a plain read of N bytes of e4m3 rows (no routing, no scales, no activation): the floor a
           Triton kernel of this shape reaches at 2-25 MB, per rows-per-program / warps / stages;
  gate_up  the engine's routed gate/up kernel (ROUTE_K = 8) against the same kernel reading
           precomputed ids (ROUTE_K = 0): what the routing before the first weight load costs;
           then CUDA-core and tensor-core tiles (BLOCK_I, STAGES, warps);
  down     `_routed_down_kernel` (weights loaded before the PDL wait) per BLOCK_H and warps.

Every MoE candidate's output is checked against a dequantised torch reference (relative RMSE < 1e-2)
before it is timed. --tokens T1,T2,..: the MoE parts at each decode batch size of the routed-rows path
(FP8: 1-4 tokens). Writes $OUT/moe_bs1_probe.json, each T's best gate/up and down tiles as the "fp8,T"
pair configs in $OUT/moe_pair_tuned.json (for METAINFER_MOE_TUNED), and prints a table per T.

    python experiments/moe_bs1_probe.py --out $OUT
    python experiments/moe_bs1_probe.py --parts gate_up,down --tokens 2,3,4 --out $OUT
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
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' helpers
from kernels_b import gap_kernel, rel_rmse, time_graph  # noqa: E402

from metainfer.kernels import moe, routing  # noqa: E402
from metainfer.kernels.ops import ref_dequant_fp8  # noqa: E402
from metainfer.model.fp8 import quantize_fp8_block  # noqa: E402

H, I, E, TOP_K = 2048, 512, 256, 8
W = TOP_K + 1  # 8 routed slots + the shared expert (id E)
BW = 4.3e12
CALLS = 40  # one step's layers


@triton.jit
def _stream_kernel(w_ptr, out_ptr, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   STAGES: tl.constexpr):
    """Program p sums rows [p * BLOCK_R, (p + 1) * BLOCK_R) of an e4m3 [rows, K] matrix."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc += tl.load(w_ptr + rows[:, None] * K + k0 + tl.arange(0, BLOCK_K)[None, :]).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


def stream_probe(pool: torch.Tensor, nbytes: int, block_r: int, warps: int, stages: int) -> float:
    rows = nbytes // H
    chunks = pool.numel() // (rows * H)
    out = torch.empty(rows // block_r, device="cuda")
    x = torch.randn(1, H, device="cuda").bfloat16()

    def call(i):
        gap_kernel(x)
        w = pool[(i % chunks) * rows * H:][: rows * H]
        _stream_kernel[(rows // block_r,)](w, out, K=H, BLOCK_R=block_r, BLOCK_K=128, STAGES=stages,
                                           num_warps=warps)

    return time_graph(call, CALLS)


class Experts:
    """COPIES layers of FP8 experts (257 each: 256 routed + the shared one), CALLS routings of T tokens."""

    COPIES = 4

    def __init__(self) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        self.gu, self.dn, self.T = [], [], 0
        for _ in range(self.COPIES):
            self.gu.append(quantize_fp8_block((torch.randn(E + 1, 2 * I, H, device="cuda", generator=g)
                                               / H**0.5).bfloat16()))
            self.dn.append(quantize_fp8_block((torch.randn(E + 1, H, I, device="cuda", generator=g)
                                               / I**0.5).bfloat16()))

    def tokens(self, T: int) -> None:
        """New inputs and routings: CALLS of T tokens each."""
        g = torch.Generator(device="cuda").manual_seed(T)
        self.T = T
        self.x = [torch.randn(T, H, device="cuda", generator=g).bfloat16() for _ in range(CALLS)]
        self.logits = [(torch.randn(T, E + 1, device="cuda", generator=g) * 2).bfloat16()
                       for _ in range(CALLS)]
        self.tw, self.ids = [], []
        for lg in self.logits:
            tw, ids = routing.route_topk(lg, TOP_K, shared=True)
            self.tw.append(tw)
            self.ids.append(ids)

    def reference(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(act [T*W, I], rows [T*W, H]) of call i, from the dequantised experts."""
        (wq, ws), (dq, ds) = self.gu[i % self.COPIES], self.dn[i % self.COPIES]
        ids = self.ids[i].flatten()
        pick = lambda q: q.view(torch.uint8)[ids].view(torch.float8_e4m3fn)  # noqa: E731
        wgu = ref_dequant_fp8(pick(wq), ws[ids], torch.float32)
        wdn = ref_dequant_fp8(pick(dq), ds[ids], torch.float32)
        xs = self.x[i].float().repeat_interleave(W, dim=0)  # pair p = (token p // W, slot p % W)
        gu = torch.einsum("pnk,pk->pn", wgu, xs)
        act = (F.silu(gu[:, :I]) * gu[:, I:]).bfloat16()
        return act, torch.einsum("phk,pk->ph", wdn, act.float())

    def gate_up(self, i: int, cfg: dict, route: bool) -> torch.Tensor:
        (wq, ws) = self.gu[i % self.COPIES]
        sc = moe._scale_args(ws, wq)
        if route:
            ids = torch.empty(self.T, W, dtype=torch.int64, device="cuda")
            tw = torch.empty(self.T, W, dtype=torch.float32, device="cuda")
            return moe._pair_gate_up(self.x[i], wq, sc, ids, True, cfg, route=(self.logits[i], TOP_K, tw))
        return moe._pair_gate_up(self.x[i], wq, sc, self.ids[i], True, cfg)

    def down(self, i: int, act: torch.Tensor, cfg: dict) -> torch.Tensor:
        (dq, ds) = self.dn[i % self.COPIES]
        return moe._routed_down(act, dq, moe._scale_args(ds, dq), self.logits[i], TOP_K, W, True, cfg)


def time_gate_up(ex: Experts, cfg: dict, route: bool) -> dict:
    act_ref, _ = ex.reference(0)
    err = rel_rmse(ex.gate_up(0, cfg, route), act_ref)

    def call(i):
        gap_kernel(ex.x[i])
        ex.gate_up(i, cfg, route)

    return dict(config=cfg, route=route, us=time_graph(call, CALLS), rel_err=err)


def time_down(ex: Experts, cfg: dict) -> dict:
    act_ref, rows_ref = ex.reference(0)
    err = rel_rmse(ex.down(0, act_ref, cfg), rows_ref)
    acts = [ex.reference(i)[0] for i in range(CALLS)]

    def call(i):
        gap_kernel(ex.x[i])
        ex.down(i, acts[i], cfg)

    return dict(config=cfg, us=time_graph(call, CALLS), rel_err=err)


def gate_up_candidates(T: int) -> list[dict]:
    base = moe.pair_config(T, True)
    out = [dict(base)]
    for bi, st, w in itertools.product((4, 8, 16, 32), (2, 3, 4, 6), (1, 2, 4)):
        if bi * 128 // (32 * w) >= 4:  # at least 4 bytes of each row tile per thread
            out.append(dict(base, BLOCK_I=bi, STAGES=st, num_warps=w, MMA=0))
    for bi, st, w in itertools.product((16, 32, 64), (3, 4), (2, 4)):
        out.append(dict(base, BLOCK_I=bi, STAGES=st, num_warps=w, MMA=1, DOT_F16=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--quick", action="store_true", help="the base configs only")
    ap.add_argument("--parts", default="stream,gate_up,down", help="comma list of stream, gate_up, down")
    ap.add_argument("--tokens", type=lambda v: [int(t) for t in v.split(",")], default=[1],
                    help="decode batch sizes of the routed-rows path (FP8: up to 4)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.now(UTC).isoformat(timespec="seconds"),
                pdl=os.environ.get("METAINFER_PDL", "1"))
    parts = args.parts.split(",")
    res: dict = dict(meta, stream=[], gate_up=[], down=[])

    pool = None
    if "stream" in parts:
        pool = torch.randint(0, 100, (1 << 30,), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    sizes = {"1 expert gate_up (2.1 MB)": 2 * I * H, "9 downs (9.4 MB)": 9 * H * I,
             "9 gate_ups (18.9 MB)": 9 * 2 * I * H, "in_proj (25.3 MB)": 12352 * H}
    stream_cfgs = [(16, 2, 4)] if args.quick else [
        (br, w, st) for br, w, st in itertools.product((8, 16, 32, 64), (2, 4, 8), (2, 4, 6))]
    for name, nb in sizes.items() if "stream" in parts else ():
        for br, w, st in stream_cfgs:
            if (nb // H) % br:
                continue
            try:
                us = stream_probe(pool, nb, br, w, st)
            except Exception as e:  # noqa: BLE001 (a config the compiler rejects)
                print(f"  skip stream {br},{w},{st}: {type(e).__name__}", flush=True)
                continue
            res["stream"].append(dict(size=name, bytes=nb, BLOCK_R=br, num_warps=w, STAGES=st, us=us,
                                      pct_bw=100 * nb / (us * 1e-6) / BW))
        best = min((r for r in res["stream"] if r["size"] == name), key=lambda r: r["us"])
        print(f"stream {name:28s} best {best['us']:6.2f} µs ({best['pct_bw']:.0f} % of 4.3 TB/s) "
              f"rows {best['BLOCK_R']} warps {best['num_warps']} stages {best['STAGES']}", flush=True)
    del pool
    torch.cuda.empty_cache()

    ex = Experts()
    configs = {}
    for T in args.tokens:
        configs[f"fp8,{T}"] = sweep_tokens(ex, T, parts, args.quick, res)
    (out / "moe_bs1_probe.json").write_text(json.dumps(res, indent=1))
    if all(configs.values()):
        (out / "moe_pair_tuned.json").write_text(json.dumps(dict(meta, configs=configs), indent=1))


def sweep_tokens(ex: Experts, T: int, parts: list[str], quick: bool, res: dict) -> dict | None:
    """The routed gate/up (and, once, the precomputed-ids variant) and the down kernel at T tokens:
    every candidate into res; -> the best pair of tiles as one pair config (None without both parts)."""
    ex.tokens(T)
    cands = gate_up_candidates(T)[: 1 if quick else None]
    gate_up, down = [], []
    for cfg in cands if "gate_up" in parts else ():
        for route in ((True, False) if cfg is cands[0] else (True,)):
            try:
                r = dict(time_gate_up(ex, cfg, route), T=T)
            except Exception as e:  # noqa: BLE001
                print(f"  skip gate_up {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            gate_up.append(r)
            print(f"gate_up T={T} route={int(route)} {r['us']:7.2f} µs err {r['rel_err']:.1e} {cfg}",
                  flush=True)
    base = moe.pair_config(T, True)
    base_down = (base.get("PRELOAD_BLOCK_H", moe.DOWN_PRELOAD_BLOCK_H),
                 base.get("DOWN_WARPS", base["num_warps"]))
    for bh, w in itertools.product((16, 32, 64, 128), (1, 2, 4, 8)):
        if "down" not in parts or (quick and (bh, w) != base_down):
            continue
        cfg = dict(base, PRELOAD_BLOCK_H=bh, DOWN_WARPS=w)
        try:
            r = dict(time_down(ex, cfg), T=T, base=(bh, w) == base_down)
        except Exception as e:  # noqa: BLE001
            print(f"  skip down {bh},{w}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        down.append(r)
        print(f"down T={T} BLOCK_H={bh} warps={w} {r['us']:7.2f} µs err {r['rel_err']:.1e}", flush=True)
    res["gate_up"] += gate_up
    res["down"] += down
    if not gate_up or not down:
        return None
    ok = lambda rows: [r for r in rows if r["rel_err"] < 1e-2]  # noqa: E731
    gbest = min(ok([r for r in gate_up if r["route"]]), key=lambda r: r["us"])
    dbest = min(ok(down), key=lambda r: r["us"])
    print(f"\n| T = {T} | µs | config |\n|---|---|---|")
    for label, r in [("gate_up routed (engine)", gate_up[0]), ("gate_up, ids precomputed", gate_up[1]),
                     ("gate_up best (routed)", gbest),
                     ("down (engine)", next((r for r in down if r["base"]), down[0])), ("down best", dbest)]:
        print(f"| {label} | {r['us']:.2f} | {r['config']} |")
    return dict(gbest["config"], DOWN_WARPS=dbest["config"]["DOWN_WARPS"],
                PRELOAD_BLOCK_H=dbest["config"]["PRELOAD_BLOCK_H"])

if __name__ == "__main__":
    main()
