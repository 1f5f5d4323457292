"""Builds gemv.cu (the default path's FP8 projection of one token) into a cubin with nvcc (sm_90a; cached
by the sources' hash under METAINFER_CACHE) and gives the CUDA driver API's few entry points (ctypes on
libcuda) that `gemv` launches it through, on the current torch stream, so a launch can be captured in a
CUDA graph like any kernel. No torch extension build: nvcc alone, seconds.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

from metainfer.settings import settings

HERE = Path(__file__).resolve().parent
SOURCES = ("ptx.cuh", "gemv_math.cuh",  # the parts gemv.cu includes (the cubin cache's key)
           "gemv_args.cuh", "gemv_io.cuh", "gemv_sync.cuh", "gemv_timeline.cuh")
MAINS = ("gemv.cu",)  # the translation units built here (build(main=...)); each hashes SOURCES too
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-cubin")


def nvcc_command(out: Path, defines: tuple[str, ...] = (), src: Path = HERE,
                 main: str = "gemv.cu") -> list[str]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError(f"nvcc (CUDA 12.4+) must be on PATH to build {main}")
    return [nvcc, *NVCC_FLAGS, *defines, "-o", str(out), str(src / main)]


def build(defines: tuple[str, ...] = (), src: Path = HERE, main: str = "gemv.cu") -> Path:
    """The cubin for the sources in src (default: this package's; another folder holds an older tree's
    copy for an A/B in one process), extra -D flags in defines (e.g. "-DGEMV_TIMELINE=1"), compiled once
    per source hash and flags. main: the translation unit (gemv.cu)."""
    if main not in MAINS:
        raise ValueError(f"cuda build: {main!r} is not one of {MAINS}")
    for d in defines:
        if not d.startswith("-D") or any(c.isspace() for c in d):
            raise ValueError(f"cuda build: {d!r} is not one -DNAME[=VALUE] flag")
    h = hashlib.sha256(main.encode())
    for name in dict.fromkeys((main, *SOURCES)):
        h.update((src / name).read_bytes())
    h.update(" ".join(NVCC_FLAGS + tuple(defines)).encode())
    root = settings().cache_dir / "cuda"
    out = root / f"{Path(main).stem}-{h.hexdigest()[:16]}.cubin"
    if not out.is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        res = subprocess.run(nvcc_command(tmp, defines, src, main), capture_output=True, text=True,
                             timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed on {main}:\n{res.stderr[-4000:]}")
        tmp.replace(out)
    return out


def kernel_params(args: list) -> ctypes.Array:
    """cuLaunchKernel's kernelParams for ctypes values (c_void_p for pointers; any ctypes object passed by
    value, e.g. a CUtensorMap's 128 bytes), in the kernel's parameter order. Keep `args` alive until the
    launch."""
    return (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])


def encode_tensor_map(drv: _Driver, w: torch.Tensor, width: int, box_rows: int) -> bytes:
    """The 2-D TMA map (CUtensorMap, 128 opaque bytes) of w's bytes viewed as [w.nbytes / width, width]: boxes
    of 128 bytes x box_rows, 128-byte swizzle."""
    tmap = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 2)(width, w.numel() * w.element_size() // width)
    strides = (ctypes.c_uint64 * 1)(width)
    box = (ctypes.c_uint32 * 2)(128, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    # uint8, rank 2, no interleave, SWIZZLE_128B (3), L2 promotion 128B (2), no OOB fill (zeros)
    drv("cuTensorMapEncodeTiled", tmap, 0, 2, ctypes.c_void_p(w.data_ptr()), dims, strides, box, elem,
        0, 3, 2, 0)
    return bytes(tmap)


class _Driver:
    """The few libcuda entry points used here, each call checked."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{name} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")
