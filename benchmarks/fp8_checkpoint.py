"""The published checkpoint layouts at full size, from the dummy weights (the real checkpoints cannot be
fetched): write them as a checkpoint (`metainfer.model.export`, FP8 and/or BF16 layout), load it back
as the engine does (ModelSource -> build_model -> load_checkpoint) from a cold page cache, time the
load beside the disk's own sequential read speed, and compare every engine tensor (weights, FP8
scales) bit for bit with the engine built from the same dummy weights (FP8: quantised online), by
digests, so that only one model is on the GPU at a time.

    python benchmarks/fp8_checkpoint.py --dir /tmp/ckpt --formats fp8 --keep --out $OUT
    python benchmarks/fp8_checkpoint.py --config tiny.json --device cpu --dir /tmp/ckpt --out /tmp/o

Writes fp8_checkpoint.json (figures per format: bytes, shards, write seconds, cold disk read GB/s,
cold load seconds and GB/s, warm load seconds, tensors compared, the mismatched ones). The page
cache is dropped per shard file (fsync + posix_fadvise DONTNEED); `page_cache_dropped` says whether
that worked. A format whose checkpoint does not fit the disk is skipped with the reason.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_smoke import env_info  # noqa: E402

from metainfer.config import ModelConfig  # noqa: E402
from metainfer.engine.runner import ModelSource  # noqa: E402
from metainfer.model.export import checkpoint_nbytes, dummy_model, write_checkpoint  # noqa: E402
from metainfer.model.fp8 import fp8_linears, fp8_moes, quantize_model_fp8  # noqa: E402
from metainfer.model.weights import build_model, checkpoint_files, load_checkpoint  # noqa: E402
from metainfer.oracle.digest import tensor_digest  # noqa: E402

FULL_CONFIG = Path(__file__).resolve().parents[1] / "metainfer/configs/qwen3.6-35b-a3b.json"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def drop_cache(files: list[Path]) -> bool:
    """Evicts the files' pages from the page cache; whether the OS took the advice."""
    ok = hasattr(os, "posix_fadvise")
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            if ok:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return ok


def disk_read(files: list[Path], chunk: int = 64 << 20) -> float:
    """Seconds to read the files sequentially (the disk's speed when the cache was dropped)."""
    buf = bytearray(chunk)
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t0


def engine_tensors(model) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    for name, lin in fp8_linears(model):
        if lin.weight_scale_inv is not None:
            out[f"{name}.weight_scale_inv"] = lin.weight_scale_inv
    for i, moe in enumerate(fp8_moes(model)):
        if moe.w_gate_up_scale is not None:
            out[f"moe{i}.w_gate_up_scale"] = moe.w_gate_up_scale
            out[f"moe{i}.w_down_scale"] = moe.w_down_scale
    return out


def load(ck: Path, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, float]:
    """The engine's load path; seconds from nothing to every tensor on the device."""
    t0 = time.perf_counter()
    source = ModelSource.parse(str(ck))
    _, scheme = source.quantization(None)
    cfg = ModelConfig.from_hf(source.config_path)
    model = build_model(cfg, dtype, torch.device(device), fp8=scheme is not None)
    load_checkpoint(model, ck, progress=True, fp8=scheme)
    _sync(device)
    return model, time.perf_counter() - t0


def run_format(fmt: str, args, dtype: torch.dtype) -> dict:
    cfg, device = Path(args.config), args.device
    ck = Path(args.dir) / fmt
    scale_dtype = getattr(torch, args.scale_dtype)
    model = dummy_model(cfg, args.seed, device, dtype)
    nbytes = checkpoint_nbytes(model, fmt, scale_dtype)
    ck.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(ck).free + sum(f.stat().st_size for f in ck.glob("*.safetensors"))
    if nbytes + (1 << 30) > free:
        return {"skipped": f"needs {nbytes / 1e9:.1f} GB on disk, {free / 1e9:.1f} GB free at {ck}"}
    t0 = time.perf_counter()
    paths = write_checkpoint(model, cfg, ck, fmt, int(args.shard_gb * 1e9), scale_dtype)
    write_s = time.perf_counter() - t0
    del model
    _free(device)
    files = checkpoint_files(ck)
    on_disk = sum(f.stat().st_size for f in files)
    dropped = drop_cache(files)
    read_s = disk_read(files)
    drop_cache(files)
    loaded, load_s = load(ck, dtype, device)
    got = {n: tensor_digest(t) for n, t in engine_tensors(loaded).items()}
    del loaded
    _free(device)
    warm, warm_s = load(ck, dtype, device)  # the same files, now in the page cache
    del warm
    _free(device)
    ref = dummy_model(cfg, args.seed, device, dtype)
    if fmt == "fp8":
        quantize_model_fp8(ref)
    want = {n: tensor_digest(t) for n, t in engine_tensors(ref).items()}
    del ref
    _free(device)
    mismatched = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
    if not args.keep:
        shutil.rmtree(ck)
    return {
        "dir": str(ck), "kept": args.keep, "shards": len(paths), "tensor_bytes": nbytes,
        "file_bytes": on_disk,
        "write_s": round(write_s, 2), "page_cache_dropped": dropped,
        "disk_read_s": round(read_s, 2), "disk_read_gbps": round(on_disk / read_s / 1e9, 2),
        "load_cold_s": round(load_s, 2), "load_cold_gbps": round(on_disk / load_s / 1e9, 2),
        "load_warm_s": round(warm_s, 2), "tensors_compared": len(want), "mismatched": mismatched[:20],
        "bit_identical": not mismatched,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(FULL_CONFIG))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", required=True, help="where the checkpoints are written (local disk)")
    ap.add_argument("--formats", default="fp8", help="comma-separated: fp8, bf16 (default: fp8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--scale-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (e.g. for metainfer verify)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    result = {"env": env_info(), "config": args.config, "device": args.device, "dtype": str(dtype),
              "scale_dtype": args.scale_dtype, "seed": args.seed, "formats": {}}
    print(json.dumps({k: v for k, v in result.items() if k != "formats"}), file=sys.stderr)
    for fmt in args.formats.split(","):
        result["formats"][fmt] = run_format(fmt, args, dtype)
        print(fmt, json.dumps(result["formats"][fmt]), file=sys.stderr)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fp8_checkpoint.json").write_text(json.dumps(result, indent=2) + "\n")
    ok = all(r.get("bit_identical", True) for r in result["formats"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
