# History: the megakernel left the product. This script imports its code (metainfer.kernels.mega), whose last
# commit is b4eb65f: run it from that tree (git worktree add /tmp/mega b4eb65f). Kept as the record of
# KB-0075..0091.
# ruff: noqa: I001  (metainfer.kernels.mega is not in this tree: isort would take it for a third-party module)
"""The megakernel v0 (metainfer/kernels/mega) on the batch-1 step's GEMV bytes: one launch runs every
dense and expert projection of the 40 layers and the lm_head as chained GEMV instructions on random
weights, with the step's shapes (k of 2048, 4096 and 512; the bf16 router; FP8 or BF16 lm_head).

Per layer: in_proj (DeltaNet, 12,352 rows) or qkv (attention, 9,216), each from the residual stream
through the RMSNorm prologue; out_proj / o_proj (k 4096) from it; the router (bf16, 257 rows) and the
9 experts' gate/up (9,216 rows) from that through the RMSNorm prologue; the 9 down projections (k 512)
from gate/up's slices, the last of which is the next layer's residual stream. No recurrent state, no
attention, no routing: the step's GEMV skeleton only, so each instruction waits for its source where
the real step would (about 5 hops per layer).

Modes: `chain` as above; `free`, every instruction reading the launch input (no hop waits: the
streaming rate of the kernel). Prints a table (ms, GB/s, % of 4.3 TB/s) and checks a sample of
instructions against program.reference.

  python experiments/mega_bench.py --json out/mega_bench.json [--reps 20] [--lm-head fp8|bf16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' helpers

from engine_smoke import env_info  # noqa: E402

from metainfer.config import FULL, ModelConfig  # noqa: E402
from metainfer.kernels.mega import emulate, profile  # noqa: E402
from metainfer.kernels.mega import program as P  # noqa: E402
from metainfer.kernels.mega.launch import MegaKernel  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "metainfer" / "configs" / "qwen3.6-35b-a3b.json"
HBM = 4.3e12


def _e4m3(rows, k, g):
    w = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=g.device)
    for r0 in range(0, rows, 16384):  # fp32 temporaries of at most 128 MB
        r1 = min(rows, r0 + 16384)
        w[r0:r1] = (torch.randn(r1 - r0, k, device=g.device, generator=g) * 2).to(torch.float8_e4m3fn)
    ws = (0.5 + 1.5 * torch.rand((rows + 127) // 128, k // 128, device=g.device, generator=g)) / 256
    return w, ws


def _bf16(shape, g, scale):
    return (torch.randn(shape, device=g.device, generator=g) * scale).to(torch.bfloat16)


def build(cfg: ModelConfig, lm_head: str, free: bool, seed: int = 0, device: str = "cuda") -> list[P.Gemv]:
    """The instructions (checked by P.Program) of one step's GEMVs for cfg, random weights on device."""
    g = torch.Generator(device=device).manual_seed(seed)
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok + 1
    x0 = _bf16(H, g, 1.0)
    nw = _bf16(H, g, 0.1)
    instrs: list[P.Gemv] = []

    def add(w, ws, src, off=0, norm=False, bf16=True):
        out = P.OUT_BF16 if bf16 else P.OUT_F32
        if free:  # every instruction from the launch input (k of 4096 / 512: a vector of its own)
            x = P.Vec(x0 if w.shape[1] == H else _bf16(w.shape[1], g, 1.0))
            instrs.append(P.Gemv(w, x, ws=ws, norm_w=nw if norm else None, out=out))
        else:
            x = P.Vec(x0) if src < 0 else P.Src(src, off)
            instrs.append(P.Gemv(w, x, ws=ws, norm_w=nw if norm else None, out=out))
        return len(instrs) - 1

    h = -1  # the residual stream: the launch input, then each layer's last down projection
    for t in cfg.layer_types:
        rows = 2 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim
        if t != FULL:
            rows = cfg.linear_conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads
        mix = add(*_e4m3(rows, H, g), h, norm=True)
        k_out = cfg.num_attention_heads * cfg.head_dim if t == FULL else cfg.linear_value_dim
        o = add(*_e4m3(H, k_out, g), mix)
        add(_bf16((cfg.num_experts + 1, H), g, 0.05), None, o, norm=True, bf16=False)
        gu = add(*_e4m3(E * 2 * I, H, g), o, norm=True)
        for j in range(E):
            h = add(*_e4m3(H, I, g), gu, off=j * 2 * I)
    if lm_head == "fp8":
        add(*_e4m3(cfg.vocab_size, H, g), h, norm=True, bf16=False)
    else:
        add(_bf16((cfg.vocab_size, H), g, 0.02), None, h, norm=True, bf16=False)
    return instrs


def time_launches(kernel: MegaKernel, prog: P.Program, reps: int, mma: bool = False) -> list[float]:
    ms = []
    for i in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        kernel.launch(prog, mma=mma)
        b.record()
        b.synchronize()
        if i >= 2:
            ms.append(a.elapsed_time(b))
    return sorted(ms)


def sample_check(prog: P.Program, n: int = 6) -> float:
    """The worst relative RMSE over a sample of instructions (the first, the last, a few between), each
    against emulate.py from the kernel's outputs of the instructions before it."""
    idx = sorted({0, len(prog.instrs) - 1, *range(1, len(prog.instrs) - 1, max(1, len(prog.instrs) // n))})
    vals = [prog.values(j) for j in range(len(prog.instrs))]
    worst = 0.0
    for i in idx:
        got = vals[i].double()
        want = emulate.one(prog.instrs[i], vals[:i], prog.step_inputs.cpu()).double()
        err = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(1e-30))
        worst = max(worst, err if torch.isfinite(got).all() else float("inf"))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--lm-head", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--modes", default="chain,free")
    ap.add_argument("--prof", action="store_true",
                    help="each mode also once in the profiling build (profile.py)")
    ap.add_argument("--mma", default="0",
                    help="consumer kinds: 0 CUDA cores, 1 tensor cores (e4m3, K <= 2048)")
    args = ap.parse_args()
    cfg = ModelConfig.from_hf(CONFIG)
    kernel = MegaKernel("cuda")
    pk = MegaKernel("cuda", prof=True) if args.prof else None
    rows, profiles = [], []
    for mode, mma in [(m, int(v)) for m in args.modes.split(",") for v in args.mma.split(",")]:
        prog = P.Program(build(cfg, args.lm_head, free=mode == "free"))
        ms = time_launches(kernel, prog, args.reps, mma=bool(mma))
        if prog.error():
            raise SystemExit(f"megakernel ({mode}): {prog.error()}")
        med = ms[len(ms) // 2]
        err = sample_check(prog)
        rows.append({"mode": mode, "mma": mma, "instructions": len(prog.instrs), "bytes": prog.bytes,
                     "ms_median": med,
                     "ms_min": ms[0], "ms_max": ms[-1], "gb_s": prog.bytes / med / 1e6,
                     "pct_of_4_3_tb_s": 100 * prog.bytes / med / 1e-3 / HBM, "worst_rel_rmse": err,
                     "steps": prog.step()})
        if pk is not None:
            profiles.append((f"{mode} mma {mma}", profile.summarize(profile.record(pk, prog, mma=bool(mma)),
                                                                    prog.instrs, pk.num_sms)))
        del prog
        torch.cuda.empty_cache()
    print(f"megakernel v0, {torch.cuda.get_device_name()}, lm_head {args.lm_head}, {args.reps} launches each")
    print("| mode | mma | instructions | GB | ms (median) | GB/s | % of 4.3 TB/s | worst rel RMSE (sample) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['mma']} | {r['instructions']} | {r['bytes'] / 1e9:.3f} | "
              f"{r['ms_median']:.3f} | "
              f"{r['gb_s']:.0f} | {r['pct_of_4_3_tb_s']:.1f} | {r['worst_rel_rmse']:.1e} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"env": env_info(), "lm_head": args.lm_head, "reps": args.reps,
                                         "results": rows, "profiles": dict(profiles)}, indent=1))
    for name, sm in profiles:
        print(f"\n{name} (profiling build)\n" + profile.table(sm))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
