"""The megakernel consumers' rate on one ring slot, apart from the step (benchmarks/mega_chunk_bench.cu).

Per mode, the CTAs' median µs per 32 KB chunk of a 2,048-column e4m3 GEMV (consumer warp 0's span over
its chunks) and the aggregate rate over every CTA: compute only (CUDA cores, tensor cores), the ring
streaming from DRAM with those consumers, and the ring alone. DRAM's 4.3 TB/s is 1.0 µs per chunk per SM
on 132 SMs.

  python benchmarks/mega_chunk_bench.py [--chunks 48] [--reps 5] [--variants ";-DFLAG=1"] [--json F]

--variants: builds to compare, `;`-separated, each a `,`-separated list of -D flags for mega_math.cuh (the
empty one: the default build). 2026-12-02d compared an e4m3 unpack by bit placement and two FMA chains per
row this way (both slower; removed: benchmarks/results/2026-12-02d).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from metainfer.kernels.mega import launch  # noqa: E402
from metainfer.kernels.mega import program as P  # noqa: E402

HERE = Path(__file__).resolve().parent
MODES = {0: "compute only, CUDA cores (row_dot2)", 1: "compute only, tensor cores (tile_mma)",
         2: "ring from DRAM + CUDA-core consumers", 3: "ring from DRAM, consumers only release"}


def build(defines: tuple[str, ...] = ()) -> bytes:
    out = Path(tempfile.mkdtemp()) / "chunk_bench.cubin"
    cmd = [launch.nvcc_command(out)[0], *launch.NVCC_FLAGS, *defines, "-o", str(out),
           str(HERE / "mega_chunk_bench.cu")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return out.read_bytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=48, help="chunks per CTA per launch")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default="", help="-D flag lists, ';' between builds, ',' within one")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    drv = launch._Driver()
    smem = P.NSLOTS * P.SLOT + 256 + 2 * P.NSLOTS * 8 + P.KMAX * 4 + 256 * 4
    fns = {}
    for v in args.variants.split(";"):
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        drv("cuModuleLoadData", ctypes.byref(module), build(tuple(d for d in v.split(",") if d)))
        drv("cuModuleGetFunction", ctypes.byref(fn), module, b"chunk_bench")
        drv("cuFuncSetAttribute", fn, 8, smem)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        fns[v or "base"] = (module, fn)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    w_chunks = sms * 64  # 276 MB on 132 SMs: past L2, so the ring streams from DRAM
    torch.manual_seed(0)
    w = (torch.rand(w_chunks * P.SLOT, device=dev) * 2 - 1).mul(8).to(torch.float8_e4m3fn)
    x = torch.randn(2048, device=dev).to(torch.bfloat16).float()
    scales = torch.rand(16, device=dev) + 0.5
    y = torch.zeros(sms * args.chunks * 16 + 16, dtype=torch.int64, device=dev)
    out = torch.zeros(sms * 2, dtype=torch.int64, device=dev)
    err = torch.zeros(4, dtype=torch.int32, device=dev)
    stream = ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)
    rows = []
    for (variant, (_, fn)), (mode, what) in itertools.product(fns.items(), MODES.items()):
        per_chunk_us, rate = [], []
        for _ in range(args.reps):
            vals = [ctypes.c_void_p(w.data_ptr()), ctypes.c_size_t(w_chunks), ctypes.c_void_p(x.data_ptr()),
                    ctypes.c_void_p(scales.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                    ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(err.data_ptr()),
                    ctypes.c_int(args.chunks), ctypes.c_int(mode)]
            ptrs = [ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals]
            params = (ctypes.c_void_p * len(vals))(*ptrs)
            drv("cuLaunchKernel", fn, sms, 1, 1, P.THREADS, 1, 1, smem, stream, params, None)
            torch.cuda.synchronize()
            ns = out.view(sms, 2)[:, 1].double()
            per_chunk_us.append(float(ns.median()) / args.chunks / 1e3)
            rate.append(sms * args.chunks * P.SLOT / float(ns.max()))  # bytes per ns = GB/s
        per_chunk_us.sort()
        rate.sort()
        rows.append({"variant": variant, "mode": mode, "what": what,
                     "us_per_chunk_median": per_chunk_us[len(per_chunk_us) // 2],
                     "aggregate_gb_s": rate[len(rate) // 2],
                     "pct_of_4300_gb_s": rate[len(rate) // 2] / 4300 * 100})
    print("| build | mode | what | µs per 32 KB chunk (CTAs' median) | aggregate GB/s | % of 4.3 TB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['mode']} | {r['what']} | {r['us_per_chunk_median']:.3f} "
              f"| {r['aggregate_gb_s']:.0f} | {r['pct_of_4300_gb_s']:.0f} |")
    if args.json:
        env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev),
               "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                        cwd=HERE).stdout.strip()}
        args.json.write_text(json.dumps({"env": env, "args": {"chunks": args.chunks, "reps": args.reps,
                                                              "variants": args.variants},
                                         "results": rows}, indent=1))


if __name__ == "__main__":
    main()
