# History: the megakernel left the product. This script imports its code (metainfer.kernels.mega), whose last
# commit is b4eb65f: run it from that tree (git worktree add /tmp/mega b4eb65f). Kept as the record of
# KB-0075..0091.
# ruff: noqa: I001  (metainfer.kernels.mega is not in this tree: isort would take it for a third-party module)
"""The megakernel consumers' rate on one ring slot, apart from the step (experiments/mega_chunk_bench.cu).

Per mode, the CTAs' median µs per 32 KB chunk of a 2,048-column e4m3 GEMV (consumer warp 0's span over
its chunks) and the aggregate rate over every CTA: compute only (CUDA cores, tensor cores), the ring
streaming from DRAM with those consumers, and the ring alone. DRAM's 4.3 TB/s is 1.0 µs per chunk per SM
on 132 SMs.

  python experiments/mega_chunk_bench.py [--chunks 48] [--reps 5] [--variants ";-DFLAG=1"] [--json F]

--variants: builds to compare, `;`-separated, each a `,`-separated list of -D flags for mega_math.cuh (the
empty one: the default build). 2026-12-02d compared an e4m3 unpack by bit placement and two FMA chains per
row this way (both slower; removed; its results page, benchmarks/results/2026-12-02d, is in git history).
"""

from __future__ import annotations

import argparse
import ctypes
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
         2: "ring from DRAM + CUDA-core consumers", 3: "ring from DRAM, consumers only release",
         4: "compute only, FP8 wgmma (x as two e4m3 terms)", 5: "ring from DRAM by TMA + FP8 wgmma",
         6: "compute only, FP8 wgmma, W as A (m64n8k32)", 7: "ring from DRAM by TMA + FP8 wgmma, W as A"}


def build(defines: tuple[str, ...] = ()) -> bytes:
    out = Path(tempfile.mkdtemp()) / "chunk_bench.cubin"
    cmd = [launch.nvcc_command(out)[0], *launch.NVCC_FLAGS, *defines, "-o", str(out),
           str(HERE / "mega_chunk_bench.cu")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return out.read_bytes()


def tensor_map(drv: launch._Driver, w: torch.Tensor, width: int, box_rows: int) -> ctypes.Array:
    """launch.encode_tensor_map's map of w ([w bytes / width, width], 128-byte boxes of box_rows, 128-byte
    swizzle) as a ctypes value, passed by value: chunk_bench_wgmma [rows, 2048], 16-row boxes;
    chunk_bench_wgmma_t [4 rows, 512], 64-row boxes."""
    return (ctypes.c_uint64 * 16).from_buffer_copy(launch.encode_tensor_map(drv, w, width, box_rows))


def reference(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """Each output row's dot: chunk [ctas, chunks] -> [ctas, chunks, 16] fp32 (e4m3 x fp32 x block scale)."""
    wc = w.view(-1, 16, 2048)[chunk.flatten()].float()  # [n, 16, 2048]
    xs = x * scales.repeat_interleave(128)
    return (wc @ xs).view(*chunk.shape, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=48, help="chunks per CTA per launch")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default="", help="-D flag lists, ';' between builds, ',' within one")
    ap.add_argument("--wgmma", action="store_true",
                    help="also modes 4-7: FP8 wgmma (x as A: chunk_bench_wgmma; W as A: chunk_bench_wgmma_t)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    drv = launch._Driver()
    smem = P.NSLOTS * P.SLOT + 256 + 2 * P.NSLOTS * 8 + P.KMAX * 4 + 256 * 4
    smem_wgmma = 1024 + P.NSLOTS * P.SLOT + 2048 * 8 + (16 + 16 + 16) * 4 + 2 * P.NSLOTS * 8  # (+ alignment)
    kernels = []  # (build, mode, what, function, shared bytes)
    for v in args.variants.split(";"):
        module = ctypes.c_void_p()
        drv("cuModuleLoadData", ctypes.byref(module), build(tuple(d for d in v.split(",") if d)))
        names = [(b"chunk_bench", smem, [m for m in MODES if m < 4])]
        if args.wgmma:
            names.append((b"chunk_bench_wgmma", smem_wgmma, [4, 5]))
            names.append((b"chunk_bench_wgmma_t", smem_wgmma, [6, 7]))
        for name, nbytes, modes in names:
            fn = ctypes.c_void_p()
            drv("cuModuleGetFunction", ctypes.byref(fn), module, name)
            drv("cuFuncSetAttribute", fn, 8, nbytes)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            kernels += [(v or "base", m, MODES[m], fn, nbytes, module) for m in modes]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    w_chunks = sms * 64  # 276 MB on 132 SMs: past L2, so the ring streams from DRAM
    torch.manual_seed(0)
    w = (torch.rand(w_chunks * P.SLOT, device=dev) * 2 - 1).mul(8).to(torch.float8_e4m3fn)
    x = torch.randn(2048, device=dev).to(torch.bfloat16).float()
    scales = torch.rand(16, device=dev) + 0.5
    y = torch.zeros(sms * args.chunks * 16 + 16, dtype=torch.int64, device=dev)
    out = torch.zeros(sms * 2, dtype=torch.int64, device=dev)
    err = torch.zeros(4, dtype=torch.int32, device=dev)
    tmap = tensor_map(drv, w, 2048, 16) if args.wgmma else None
    tmap_t = tensor_map(drv, w, 512, 64) if args.wgmma else None
    stream = ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)
    cta = torch.arange(sms, device=dev)[:, None]
    it = torch.arange(args.chunks, device=dev)[None, :]
    chunk_of = {0: (cta + 0 * it) % w_chunks, 1: (cta + 0 * it) % w_chunks, 2: (cta + it * sms) % w_chunks,
                4: (cta + (it % P.NSLOTS) * sms) % w_chunks, 5: (cta + it * sms) % w_chunks,
                6: (cta + (it % P.NSLOTS) * sms) % w_chunks, 7: (cta + it * sms) % w_chunks}
    rows = []
    print("| build | mode | what | µs per 32 KB chunk (CTAs' median) | aggregate GB/s | % of 4.3 TB/s "
          "| outputs' rel RMSE |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for variant, mode, what, fn, nbytes, _ in kernels:  # (each row printed once measured: a fault ends it)
        per_chunk_us, rate = [], []
        for _ in range(args.reps):
            head = [tmap_t] if mode >= 6 else [tmap] if mode >= 4 else [ctypes.c_void_p(w.data_ptr())]
            vals = [*head, ctypes.c_size_t(w_chunks), ctypes.c_void_p(x.data_ptr()),
                    ctypes.c_void_p(scales.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                    ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(err.data_ptr()),
                    ctypes.c_int(args.chunks), ctypes.c_int(mode)]
            params = launch.kernel_params(vals)
            y.zero_()
            drv("cuLaunchKernel", fn, sms, 1, 1, P.THREADS, 1, 1, nbytes, stream, params, None)
            torch.cuda.synchronize()
            ns = out.view(sms, 2)[:, 1].double()
            per_chunk_us.append(float(ns.median()) / args.chunks / 1e3)
            rate.append(sms * args.chunks * P.SLOT / float(ns.max()))  # bytes per ns = GB/s
        row = {"variant": variant, "mode": mode, "what": what}
        if mode in chunk_of:  # the outputs (bf16 in the tagged words' low half) against the reference
            got = (y[: sms * args.chunks * 16] & 0xFFFF).to(torch.int16).view(torch.bfloat16).float()
            want = reference(w, x, scales, chunk_of[mode]).flatten()
            row["rel_rmse_vs_fp32"] = float(((got - want).pow(2).mean() / want.pow(2).mean()).sqrt())
        per_chunk_us.sort()
        rate.sort()
        r = row | {"us_per_chunk_median": per_chunk_us[len(per_chunk_us) // 2],
                   "aggregate_gb_s": rate[len(rate) // 2],
                   "pct_of_4300_gb_s": rate[len(rate) // 2] / 4300 * 100}
        rows.append(r)
        print(f"| {r['variant']} | {r['mode']} | {r['what']} | {r['us_per_chunk_median']:.3f} "
              f"| {r['aggregate_gb_s']:.0f} | {r['pct_of_4300_gb_s']:.0f} "
              f"| {r.get('rel_rmse_vs_fp32', '-')} |", flush=True)
    if args.json:
        env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev),
               "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                        cwd=HERE).stdout.strip()}
        args.json.write_text(json.dumps({"env": env, "args": {"chunks": args.chunks, "reps": args.reps,
                                                              "variants": args.variants, "wgmma": args.wgmma},
                                         "results": rows}, indent=1))


if __name__ == "__main__":
    main()
