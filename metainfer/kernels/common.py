"""Pieces the Triton kernel modules share: the dot helpers for exact low-precision operands, the
interpreter switch, the SM count and the measured-config tables."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch
import triton
import triton.language as tl

from metainfer.settings import settings

TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_NUM_SMS: dict[torch.device, int] = {}


def interpreting() -> bool:
    """Kernels run on the Triton interpreter (TRITON_INTERPRET=1)."""
    return settings().triton_interpret


def upcast_dots(x: torch.Tensor) -> bool:
    """fp32 operands for the dots (`mma`, `wdot` UPCAST): on the interpreter (its bf16 dot is
    wrong) and for fp32 activations."""
    return interpreting() or x.dtype == torch.float32


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device (4 for the CPU interpreter's launches)."""
    if device.type != "cuda":
        return 4
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


_TUNED: dict[tuple[str, Path | None, str | None], dict[str, dict]] = {}
DEPLOYMENT_GPU = "h200"  # the committed tables' GPU, used on a GPU that has none of its own


def gpu_slug(name: str) -> str:
    """A GPU's part of a tuned table's file name: its first two words without the vendor's,
    lowercased ("NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100_80gb")."""
    vendor = ("nvidia", "tesla", "geforce")
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in vendor]
    return "_".join(words[:2]) or "gpu"


def tuned_table_file(family: str, gpu: str | None) -> Path:
    """The committed table of `family` (e.g. "fp8_skinny") for the GPU named `gpu`: its own table when one
    is committed, else the deployment GPU's."""
    here = Path(__file__).parent
    own = here / f"{family}_{gpu_slug(gpu)}.json" if gpu else None
    return own if own is not None and own.is_file() else here / f"{family}_{DEPLOYMENT_GPU}.json"


@functools.cache
def _gpu_name() -> str | None:
    """This process's GPU (one engine, one GPU), asked once."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def load_tuned(family: str, override: Path | None) -> dict[str, dict]:
    """Measured kernel configs: the committed table of `family` for this process's GPU
    (`tuned_table_file`), each key overridden by the JSON file `override` (same format:
    {"configs": {key: config}}). Cached."""
    gpu = _gpu_name()
    key = (family, override, gpu)
    if key not in _TUNED:
        import json

        table: dict[str, dict] = {}
        for f in (tuned_table_file(family, gpu), override):
            if f is not None and f.is_file():
                table.update(json.loads(f.read_text()).get("configs", {}))
        _TUNED[key] = table
    return _TUNED[key]


@triton.jit
def gated_norm(c, z, gw, eps, D, AX: tl.constexpr, MID: tl.constexpr):
    """The DeltaNet gated RMSNorm (`reference.gated_rms_norm`'s math and roundings) of heads of D values
    along axis AX of c, z (gw [D] broadcast on the last axis) -> its output in c's dtype, as stored:
    `norm._gated_rms_norm_kernel` and the out_proj prologue of `weight_stream._gnorm_gemv_kernel`."""
    cf = c.to(tl.float32)
    rstd = tl.expand_dims(tl.rsqrt(tl.sum(cf * cf, axis=AX) / D + eps), AX)
    h = (cf * rstd).to(c.dtype).to(tl.float32)
    h = (h * gw).to(MID).to(tl.float32)
    zf = z.to(tl.float32)
    return (h * (zf * tl.sigmoid(zf))).to(c.dtype)


# ---- dot helpers (inlined into kernels) ---------------------------------------------------------
@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """a @ b with b cast to a's dtype; UPCAST: fp32 operands (the interpreter's bf16 dot is wrong;
    fp32 activations)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b.to(a.dtype))


@triton.jit
def wdot(w, x, UPCAST: tl.constexpr, DOT_F16: tl.constexpr):
    """w [M, K] (e4m3 or x's dtype) @ x [K, N] on exact operands, fp32 result. DOT_F16: fp16
    operands (e4m3 -> fp16 is one packed convert per two values; bf16 x is exact in fp16 while
    |x| < 65504); otherwise w is converted to x's dtype. UPCAST: fp32 (interpreter, fp32 x)."""
    if UPCAST:
        return tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
    if DOT_F16:
        return tl.dot(w.to(tl.float16), x.to(tl.float16))
    return tl.dot(w.to(x.dtype), x)
