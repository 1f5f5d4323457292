"""Micro-benchmarks of the norm, conv1d, gdn_decode and paged-attention kernels at the full
Qwen3.6-35B-A3B shapes (bf16), with a correctness check against the references first.

Each case builds fresh random inputs (never zeros), checks the kernel against its reference
(relative RMSE and max-abs; in-place states too), then times it:
  - `us`: triton.testing.do_bench median (L2 flushed before every call, launch overhead included);
  - `graph_us`: per call inside one CUDA graph of back-to-back calls that rotate over up to 32
    independent buffer sets (256 MB in all where the op is big enough to outgrow the 50 MB L2):
    what a captured decode step pays, without launch overhead.
Bandwidth figures count the bytes a perfect kernel must move (inputs + outputs + states once).

    python benchmarks/kernels_a.py                      # check + time, table, JSON in $OUT or ./out
    python benchmarks/kernels_a.py --only gdn,decode    # op groups: norm conv gdn decode prefill
    python benchmarks/kernels_a.py --sweep gdn,decode   # also sweep block sizes / warps / splits
    python benchmarks/kernels_a.py --dry-run            # CPU, TRITON_INTERPRET, tiny shapes
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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter is chosen when triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from metainfer.forward_meta import ForwardMeta  # noqa: E402
from metainfer.kernels import attention, conv1d, gdn_decode, norm  # noqa: E402
from metainfer.kernels import reference as ref  # noqa: E402

DRY = "--dry-run" in sys.argv
DEV = "cpu" if DRY else "cuda"
DT = torch.float32 if DRY else torch.bfloat16
BANDWIDTH = 4.3e12  # B/s, H200 measured
PEAK_FLOPS = 790e12  # dense BF16
L2_BYTES = 256 << 20  # rotate graph buffers over at least this much memory
BF16_TOL = (4e-3, 6e-2)  # (relative RMSE, max abs) of elementwise kernels vs the bf16 reference


@dataclass(frozen=True)
class Dims:
    H: int = 2048
    Hk: int = 16
    Dk: int = 128
    Hv: int = 32
    Dv: int = 128
    K: int = 4
    Hq: int = 16
    Hkv: int = 2
    D: int = 256
    bs: int = 16
    max_len: int = 8192  # block-table capacity (graph-style width)

    @property
    def C(self) -> int:
        return 2 * self.Hk * self.Dk + self.Hv * self.Dv


FULL = Dims()
TINY = Dims(H=48, Hk=2, Dk=16, Hv=4, Dv=16, Hq=4, Hkv=2, D=32, bs=4, max_len=64)


@dataclass
class Case:
    group: str
    op: str
    shape: str
    make: Callable  # seed -> (run, check): run() is one call; check() -> dict of errors
    nbytes: int
    flops: int = 0
    tol: tuple[float, float] = (1e-2, 3e-2)  # (relative RMSE, max abs) of the output
    graph: bool = True
    result: dict = field(default_factory=dict)


# ---- helpers ---------------------------------------------------------------------------------------
def rel_rmse(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def errors(got, want, prefix: str = "") -> dict:
    return {
        f"{prefix}rel_rmse": rel_rmse(got, want),
        f"{prefix}max_abs": float((got.float() - want.float()).abs().max()),
        f"{prefix}finite": bool(torch.isfinite(got.float()).all()),
    }


def passed(err: dict, tol: tuple[float, float]) -> bool:
    ok = err["rel_rmse"] < tol[0] and err["max_abs"] < tol[1] and err["finite"]
    ok = ok and all(v for k, v in err.items() if k.endswith("_exact"))
    if "state_rel_rmse" in err:
        ok = ok and err["state_rel_rmse"] < 1e-5 and err["state_finite"]
    return ok


# ---- cases -----------------------------------------------------------------------------------------
def norm_cases(d: Dims, Ts: list[int]) -> list[Case]:
    eps = 1e-6
    cases = []

    def rms(T):
        def make(seed):
            g = gen(seed)
            x = randn(g, T, d.H)
            w = 0.1 * randn(g, d.H)

            def run():
                return norm.rms_norm(x, w, eps)

            return run, lambda: errors(run(), ref.rms_norm(x, w, eps))
        return Case("norm", "rms_norm", f"[{T},{d.H}]", make, 2 * T * d.H * 2 + d.H * 2, tol=BF16_TOL)

    def qnorm(T):
        def make(seed):
            g = gen(seed)
            q = randn(g, T, d.Hq, 2 * d.D)[..., : d.D]
            w = 0.1 * randn(g, d.D)

            def run():
                return norm.rms_norm(q, w, eps)

            return run, lambda: errors(run(), ref.rms_norm(q, w, eps))
        return Case("norm", "rms_norm(q heads)", f"[{T},{d.Hq},{d.D}]/{2 * d.D}", make,
                    2 * T * d.Hq * d.D * 2, tol=BF16_TOL)

    def add(T):
        def make(seed):
            g = gen(seed)
            x, r, w = randn(g, T, d.H), randn(g, T, d.H), 0.1 * randn(g, d.H)

            def check():
                out, new_r = norm.add_rms_norm(x, r, w, eps)
                want, want_r = ref.add_rms_norm(x, r, w, eps)
                return {**errors(out, want), "residual_exact": bool(torch.equal(new_r, want_r))}
            return (lambda: norm.add_rms_norm(x, r, w, eps)), check
        return Case("norm", "add_rms_norm", f"[{T},{d.H}]", make, 4 * T * d.H * 2 + d.H * 2, tol=BF16_TOL)

    def gated(T):
        def make(seed):
            g = gen(seed)
            x = randn(g, T, d.Hv, d.Dv)
            z = randn(g, T, 2 * d.Hv * d.Dv)[:, d.Hv * d.Dv :].view(T, d.Hv, d.Dv)
            w = 1 + 0.1 * randn(g, d.Dv)

            def run():
                return norm.gated_rms_norm(x, z, w, eps)

            return run, lambda: errors(run(), ref.gated_rms_norm(x, z, w, eps))
        return Case("norm", "gated_rms_norm", f"[{T},{d.Hv},{d.Dv}]", make, 3 * T * d.Hv * d.Dv * 2,
                    tol=BF16_TOL)

    for T in Ts:
        cases += [rms(T), add(T), gated(T)]
    cases += [qnorm(T) for T in Ts[:2]]
    return cases


def _deltanet_inputs(d: Dims, B: int, seed: int):
    g = gen(seed)
    S = B + 1
    mixed = randn(g, B, d.C + 4096)[:, : d.C]  # strided rows, as split from in_proj's output
    conv_state = randn(g, S, d.K - 1, d.C)
    conv_w = 0.5 * randn(g, d.C, d.K)
    ssm = 0.5 * torch.randn(S, d.Hv, d.Dk, d.Dv, device=DEV, generator=g)
    slots = torch.randperm(S, device=DEV, generator=g)[:B]
    has = torch.rand(B, device=DEV, generator=g) > 0.1
    gdec = -2 * torch.rand(B, d.Hv, device=DEV, generator=g)
    beta = torch.rand(B, d.Hv, device=DEV, generator=g).to(DT)
    return mixed, conv_state, conv_w, ssm, slots, has, gdec, beta


def conv_case(d: Dims, B: int) -> Case:
    def make(seed):
        mixed, conv_state, conv_w, _, slots, has, _, _ = _deltanet_inputs(d, B, seed)

        def check():
            s1, s2 = conv_state.clone(), conv_state.clone()
            err = errors(conv1d.causal_conv1d_update(mixed, s1, conv_w, slots, has),
                         ref.causal_conv1d_update(mixed, s2, conv_w, slots, has))
            return {**err, "state_exact": bool(torch.equal(s1, s2))}
        return (lambda: conv1d.causal_conv1d_update(mixed, conv_state, conv_w, slots, has)), check
    nbytes = (2 * B * d.C + 2 * B * (d.K - 1) * d.C + d.C * d.K) * 2
    # the reference rounds each tap product to bf16; the kernel sums exact products in fp32
    return Case("conv", "causal_conv1d_update", f"B={B} C={d.C}", make, nbytes, tol=(8e-3, 1e-1))


def gdn_case(d: Dims, B: int) -> Case:
    def make(seed):
        mixed, _, _, ssm, slots, has, gdec, beta = _deltanet_inputs(d, B, seed)
        q, k, v = torch.split(mixed, [d.Hk * d.Dk, d.Hk * d.Dk, d.Hv * d.Dv], dim=-1)
        q, k, v = q.view(B, d.Hk, d.Dk), k.view(B, d.Hk, d.Dk), v.view(B, d.Hv, d.Dv)
        q, k = q / 4, k / 4

        def check():
            s1 = ssm.clone()
            out = gdn_decode.gdn_decode(q, k, v, gdec, beta, s1, slots, has)
            init = ssm[slots] * has[:, None, None, None].float()
            want, final = ref.gated_delta_rule_recurrent(
                q[:, None], k[:, None], v[:, None], gdec[:, None], beta[:, None], init)
            s2 = ssm.clone()
            s2[slots] = final
            err = errors(out, want[:, 0])
            return {**err, "state_rel_rmse": rel_rmse(s1, s2), "state_finite": bool(torch.isfinite(s1).all())}
        return (lambda: gdn_decode.gdn_decode(q, k, v, gdec, beta, ssm, slots, has)), check
    nbytes = (2 * B * d.Hv * d.Dk * d.Dv * 4 + 2 * B * d.Hk * d.Dk * 2 + 2 * B * d.Hv * d.Dv * 2
              + B * d.Hv * (4 + 2))
    return Case("gdn", "gdn_decode", f"B={B}", make, nbytes, tol=BF16_TOL)


def attn_case(d: Dims, group: str, query_lens: list[int], context_lens: list[int], label: str) -> Case:
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    width = max(d.max_len // d.bs, max(-(-n // d.bs) for n in seq_lens))
    scale = d.D**-0.5

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        need = [-(-n // d.bs) for n in seq_lens]
        N = sum(need) + 1
        perm = (torch.randperm(N - 1, generator=g) + 1).tolist()
        tables, at = [], 0
        for n in need:
            tables.append(perm[at : at + n])
            at += n
        meta = ForwardMeta.build(
            query_lens=query_lens, context_lens=context_lens, block_tables=tables,
            state_slots=list(range(len(query_lens))), block_size=d.bs, logits_rows=[], device=DEV,
            max_blocks=width,
        )
        gd = gen(seed)
        kc, vc = randn(gd, N, d.bs, d.Hkv, d.D), randn(gd, N, d.bs, d.Hkv, d.D)
        q = randn(gd, sum(query_lens), d.Hq, d.D)

        def check():
            want = ref.paged_attention(q.float(), kc.float(), vc.float(), meta.block_tables,
                                       meta.query_start_loc_cpu, meta.seq_lens_cpu, scale).to(DT)
            return errors(attention.paged_attention(q, kc, vc, meta, scale), want)
        return (lambda: attention.paged_attention(q, kc, vc, meta, scale)), check

    kv = sum(seq_lens) * d.Hkv * d.D * 2 * 2
    io = sum(query_lens) * d.Hq * d.D * 2 * 2
    pairs = sum(sum(range(c + 1, c + q + 1)) for c, q in zip(context_lens, query_lens))
    return Case(group, "paged_attention", label, make, kv + io, flops=4 * d.D * d.Hq * pairs,
                tol=(1e-2, 3e-2), graph=group == "decode")


def all_cases(d: Dims, dry: bool) -> list[Case]:
    if dry:
        return (norm_cases(d, [1, 5]) + [conv_case(d, 3), gdn_case(d, 3)]
                + [attn_case(d, "decode", [1] * 3, [0, 17, 40], "B=3 ctx<=41"),
                   attn_case(d, "prefill", [1, 9, 4], [5, 0, 20], "mixed")])
    cases = norm_cases(d, [1, 32, 256, 4096])
    cases += [conv_case(d, B) for B in (1, 8, 32, 64, 256)]
    cases += [gdn_case(d, B) for B in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    for B, ctx in ((1, 1024), (1, 4096), (1, 8192), (8, 1024), (8, 8192), (32, 1024), (64, 1024), (64, 4096),
                   (256, 1024)):
        cases.append(attn_case(d, "decode", [1] * B, [ctx - 1] * B, f"B={B} ctx={ctx}"))
    cases.append(attn_case(d, "prefill", [1024], [0], "1x1024"))
    cases.append(attn_case(d, "prefill", [4096], [0], "1x4096"))
    cases.append(attn_case(d, "prefill", [1024] * 4, [0] * 4, "4x1024"))
    cases.append(attn_case(d, "prefill", [2048], [6144], "2048 after 6144"))
    cases.append(attn_case(d, "prefill", [1] * 32 + [1024], [1023] * 32 + [0], "32 decodes + 1x1024"))
    return cases


# ---- timing ----------------------------------------------------------------------------------------
def time_do_bench(run) -> float:
    if DRY:
        t = time.perf_counter()
        run()
        return (time.perf_counter() - t) * 1e6
    return triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median") * 1e3


def time_graph(case: Case, seed: int = 1000) -> float | None:
    if DRY or not case.graph:
        return None
    copies = max(1, min(32, math.ceil(L2_BYTES / max(case.nbytes, 1))))
    runs = [case.make(seed + i)[0] for i in range(copies)]
    calls = copies * max(1, math.ceil(20 / copies))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for r in runs:
            r()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            runs[i % copies]()
    graph.replay()
    torch.cuda.synchronize()
    reps = 10
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * calls))
    del graph, runs
    return sorted(times)[1]


def measure(case: Case) -> dict:
    run, check = case.make(0)
    err = check()
    us = time_do_bench(run)
    gus = time_graph(case)
    res = {"group": case.group, "op": case.op, "shape": case.shape, "bytes": case.nbytes, "flops": case.flops,
           "us": us, "graph_us": gus, "check": err, "tol": case.tol, "passed": passed(err, case.tol)}
    for key, t in (("", us), ("graph_", gus)):
        if t:
            res[f"{key}gbps"] = case.nbytes / t / 1e3
            res[f"{key}pct_bw"] = 100 * case.nbytes / t / 1e-6 / BANDWIDTH
            if case.flops:
                res[f"{key}tflops"] = case.flops / t / 1e6
                res[f"{key}pct_flops"] = 100 * case.flops / t / 1e-6 / PEAK_FLOPS
    return res


def _fmt(v, spec: str) -> str:
    return "-" if v is None or v == 0 else format(v, spec)


def print_table(rows: list[dict]) -> None:
    head = (f"{'op':<22}{'shape':<26}{'us':>9}{'GB/s':>8}{'%BW':>6}{'graph us':>10}{'%BW':>6}"
            f"{'TFLOP/s':>9}{'bytes':>12}  {'rel_rmse':>9} {'max_abs':>8} ok")
    print(head)
    print("-" * len(head))
    for r in rows:
        tf = r.get("graph_tflops", r.get("tflops"))
        print(f"{r['op'][:21]:<22}{r['shape'][:25]:<26}{r['us']:>9.2f}{_fmt(r.get('gbps'), '.0f'):>8}"
              f"{_fmt(r.get('pct_bw'), '.1f'):>6}{_fmt(r.get('graph_us'), '.2f'):>10}"
              f"{_fmt(r.get('graph_pct_bw'), '.1f'):>6}{_fmt(tf, '.0f'):>9}"
              f"{r['bytes']:>12}  {r['check']['rel_rmse']:>9.2e} {r['check']['max_abs']:>8.1e} "
              f"{'ok' if r['passed'] else 'FAIL'}")


# ---- sweeps ----------------------------------------------------------------------------------------
def _set(obj, **kw):
    old = {k: getattr(obj, k) for k in kw}
    for k, v in kw.items():
        setattr(obj, k, v)
    return old


def sweep_spaces():
    """group -> [(label, apply)]: apply() installs a config and returns a function restoring the old one."""
    def mod_cfg(mod, **kw):
        def apply():
            old = _set(mod, **kw)
            return lambda: _set(mod, **old)
        return apply

    def attn_cfg(attr, cfg):
        def apply():
            old = getattr(attention, attr)
            setattr(attention, attr, cfg)
            return lambda: setattr(attention, attr, old)
        return apply

    dd, pp = attention.DECODE, attention.PREFILL
    return {
        "norm": [(f"ROW_ELEMS={r} warps={w}", mod_cfg(norm, ROW_ELEMS=r, NUM_WARPS=w))
                 for r, w in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16))],
        "conv": [(f"BLOCK_C={c} warps={w}", mod_cfg(conv1d, BLOCK_C=c, NUM_WARPS=w))
                 for c, w in itertools.product((256, 512, 1024, 2048), (2, 4, 8))],
        "gdn": [(f"BLOCK_V={v} warps={w}", mod_cfg(gdn_decode, BLOCK_V=v, NUM_WARPS=w))
                for v, w in itertools.product((8, 16, 32, 64), (1, 2, 4, 8))],
        "decode": [(f"block_n={n} warps={w} stages={s}",
                    attn_cfg("DECODE", replace(dd, block_n=n, num_warps=w, num_stages=s)))
                   for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3))]
        + [(f"target={t} min_split={m}",
            attn_cfg("DECODE", replace(dd, target_programs=t, min_split_tokens=m)))
           for t, m in itertools.product((132, 264, 528), (32, 64, 128))],
        "prefill": [(f"rows={r} block_n={n} warps={w} stages={s}",
                     attn_cfg("PREFILL", replace(pp, block_rows=r, block_n=n, num_warps=w, num_stages=s)))
                    for r, n, w, s in itertools.product((64, 128), (32, 64), (4, 8), (2, 3))],
    }


def run_sweep(groups: list[str], cases: list[Case]) -> dict:
    out = {}
    spaces = sweep_spaces()
    for grp in groups:
        sel = [c for c in cases if c.group == grp]
        table = {}
        for label, apply in spaces[grp]:
            restore = apply()
            row = {}
            try:
                for c in sel:
                    t = time_graph(c) if c.graph and not DRY else time_do_bench(c.make(0)[0])
                    row[f"{c.op} {c.shape}"] = t
            except Exception as e:  # a config the GPU cannot run (shared memory, registers)
                row = {"error": repr(e)[:200]}
            finally:
                restore()
            table[label] = row
            print(f"  [{grp}] {label}: " + ("  ".join(f"{k.split(' ', 1)[1]} {v:.2f}" for k, v in row.items())
                                            if "error" not in row else row["error"]), flush=True)
        best = {}
        for c in sel:
            key = f"{c.op} {c.shape}"
            ok = [(row[key], label) for label, row in table.items() if key in row]
            if ok:
                best[key] = min(ok)
        print(f"best per shape ({grp}):")
        for key, (t, label) in best.items():
            print(f"  {key:<45} {t:8.2f} us  {label}")
        out[grp] = {"table": table, "best": best}
    return out


# ---- main ------------------------------------------------------------------------------------------
def env_info() -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
    }


def current_configs() -> dict:
    return {"norm": {"ROW_ELEMS": norm.ROW_ELEMS, "NUM_WARPS": norm.NUM_WARPS},
            "conv": {"BLOCK_C": conv1d.BLOCK_C, "NUM_WARPS": conv1d.NUM_WARPS},
            "gdn": {"BLOCK_V": gdn_decode.BLOCK_V, "NUM_WARPS": gdn_decode.NUM_WARPS},
            "decode": asdict(attention.DECODE), "prefill": asdict(attention.PREFILL)}


def main() -> int:
    groups = ["norm", "conv", "gdn", "decode", "prefill"]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="directory for kernels_a.json")
    p.add_argument("--only", default=",".join(groups), help="comma list of op groups")
    p.add_argument("--sweep", default="", help="comma list of op groups to sweep configs for")
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    args = p.parse_args()
    if not DRY and not torch.cuda.is_available():
        print("needs CUDA (or --dry-run)", file=sys.stderr)
        return 2
    only = [g for g in args.only.split(",") if g]
    cases = [c for c in all_cases(TINY if DRY else FULL, DRY) if c.group in only]
    info = env_info()
    print(json.dumps(info))
    print(json.dumps(current_configs()))
    rows = []
    for c in cases:
        try:
            rows.append(measure(c))
        except Exception as e:
            nan = float("nan")
            rows.append({"group": c.group, "op": c.op, "shape": c.shape, "bytes": c.nbytes, "us": nan,
                         "check": {"rel_rmse": nan, "max_abs": nan}, "passed": False, "error": repr(e)[:500]})
            print(f"{c.op} {c.shape}: {e!r}", file=sys.stderr)
        if not DRY:
            torch.cuda.empty_cache()
    print_table(rows)
    sweep = run_sweep([g for g in args.sweep.split(",") if g], cases) if args.sweep else {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kernels_a.json"
    path.write_text(json.dumps({"env": info, "configs": current_configs(), "bandwidth": BANDWIDTH,
                                "peak_flops": PEAK_FLOPS, "cases": rows, "sweep": sweep}, indent=1))
    print(f"wrote {path}")
    return 0 if all(r["passed"] for r in rows) else 1


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEV, generator=g).to(DT)


if __name__ == "__main__":
    sys.exit(main())
