"""Content hashes of tensors, computed where they live (no copy to the host), and the weights audit.

`tensor_digest(t)` covers the dtype, the shape and the bits of every element in logical (row-major)
order, whatever the strides. The bits are reinterpreted as integers of the element's width
(bf16 -> int16, fp32 -> int32, fp8 / uint8 / bool -> uint8, 8-byte types -> int64), widened to
int64 and combined, chunk by chunk on the tensor's device, into two sums modulo 2**64 (int64
arithmetic wraps in two's complement in torch's CPU and CUDA kernels):

- weighted: sum_i bits_i * m_i, with m_i = a[i mod BLOCK] * b[i div BLOCK] odd, a and b splitmix64
  mixes of their index made odd (order-sensitive: swapped or shifted values change it; a is computed
  once per device, so a step costs a widening, a product and two sums);
- plain: sum_i bits_i.

A single changed element changes the weighted sum: its change is (b' - b) * m_i with 0 < |b' - b|
< 2**64 and m_i odd, hence invertible modulo 2**64. Reduction order does not matter (modular sums),
so equal tensors have equal digests on every device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from metainfer.oracle.compare import Check

CHUNK = 1 << 22  # elements per step: a few int64 temporaries of 32 MiB
BLOCK = 1 << 22  # period of the per-position multiplier table a
_M64 = (1 << 64) - 1
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _i64(x: int) -> int:
    """The int64 with the bits of x modulo 2**64."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits by k."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 of int64 indices, made odd."""
    z = z * _GOLDEN + _GOLDEN
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return (z ^ _srl(z, 31)) | 1


_A: dict[torch.device, torch.Tensor] = {}


def _a(n: int, device: torch.device) -> torch.Tensor:
    """a[0 .. n-1] on `device` (n <= BLOCK), cached and grown on demand."""
    a = _A.get(device)
    if a is None or a.numel() < n:
        size = min(BLOCK, max(n, 2 * (0 if a is None else a.numel()), 1 << 12))
        a = _A[device] = _mix(torch.arange(size, dtype=torch.int64, device=device))
    return a[:n]


def _b(k: int) -> int:
    """b[k] (a Python int64): the block multiplier."""
    z = ((k + 1) * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return _i64((z ^ (z >> 31)) | 1)


def _pieces(t: torch.Tensor, start: int, chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(flat index of the first element, 1-D contiguous piece) covering `t` in row-major order;
    a non-contiguous tensor is copied at most `chunk` elements (or one row) at a time."""
    if t.is_contiguous():
        flat = t.reshape(-1)
        for a in range(0, flat.numel(), chunk):
            yield start + a, flat[a : a + chunk]
    elif t.dim() == 1:
        for a in range(0, t.numel(), chunk):
            yield start + a, t[a : a + chunk].contiguous()
    else:
        row = t[0].numel()
        rows = max(1, chunk // max(row, 1))
        for r in range(0, t.shape[0], rows):
            part = t[r : r + rows]
            if part.numel() <= chunk:
                yield start + r * row, part.contiguous().reshape(-1)
            else:  # one row larger than a chunk
                yield from _pieces(part[0], start + r * row, chunk)


def tensor_digest(t: torch.Tensor, chunk: int = CHUNK) -> str:
    """A content hash of `t`: "dtype[shape]:weighted:plain" (16 hex digits each). Equal dtype,
    shape and bits <=> (up to hash collisions) equal digest; runs on t's device."""
    size = t.element_size()
    if size not in _INT_VIEW:
        raise TypeError(f"tensor_digest: no integer view for {t.dtype}")
    shape = "x".join(str(s) for s in t.shape)
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    weighted = torch.zeros((), dtype=torch.int64, device=t.device)
    plain = torch.zeros((), dtype=torch.int64, device=t.device)
    with torch.inference_mode():
        for start, piece in _pieces(t, 0, chunk):
            bits = piece.view(_INT_VIEW[size]).to(torch.int64)
            plain += bits.sum()
            pos = 0
            while pos < bits.numel():  # split at multiples of BLOCK
                k, off = divmod(start + pos, BLOCK)
                seg = bits[pos : pos + BLOCK - off]
                weighted += (seg * _a(off + seg.numel(), t.device)[off:]).sum() * _b(k)
                pos += seg.numel()
        w, p = int(weighted) & _M64, int(plain) & _M64
    return f"{str(t.dtype).removeprefix('torch.')}[{shape}]:{w:016x}{p:016x}"


class Digester:
    """Digests tensors and counts the bytes hashed and the seconds spent (for the verdict)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0

    def __call__(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> str:
        """Digest of `t`, cast to `dtype` first when given and different."""
        t0 = time.perf_counter()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        d = tensor_digest(t)
        self.bytes += t.numel() * t.element_size()
        self.seconds += time.perf_counter() - t0
        return d

    def many(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
        return {n: self(t) for n, t in tensors.items()}


@dataclass
class WeightAudit:
    """Whether the engine computed with the weights the reference was judged on.

    `expected`: canonical name -> digest of the truth (the recipe's regenerated tensor, or the tensor
    transformers loaded from the checkpoint; for mode "shared" the engine's own tensor when the setup
    was built). `engine_expected`: what each engine tensor (`engine_tensors()`, canonical names plus
    any audit-only names such as FP8 scales) must digest to at the end: `expected`, or for tensors
    the engine converted (FP8) their digest right after the engine was built. `cast`: engine and
    reference tensors digested after a cast to this dtype (`expected` was taken so too).
    `build_mismatched`: names that already differed when the setup was built (e.g. the BF16 tensors
    just before FP8 quantisation). `reference_tensors`: the reference's own tensors when they are
    not the engine's, re-digested against `expected`.
    """

    mode: str  # independent | shared-digest | checkpoint | fp8-checkpoint | shared
    seed: int | None  # the weights seed the oracle asked for (dummy models)
    source: str  # the reference's weights: recipe | checkpoint | shared
    expected: dict[str, str]
    engine_expected: dict[str, str]
    engine_tensors: Callable[[], Mapping[str, torch.Tensor]]
    reference_tensors: Callable[[], Mapping[str, torch.Tensor]] | None = None
    cast: dict[str, torch.dtype] = field(default_factory=dict)
    build_mismatched: list[str] = field(default_factory=list)
    digest: Digester = field(default_factory=Digester)

    def describe(self) -> dict:
        return {"mode": self.mode, "seed": self.seed, "source": self.source, "n_tensors": len(self.expected)}

    def check(self) -> tuple[list[Check], dict]:
        """Re-digests the engine's tensors (and the reference's, when separate) now: one check,
        `weights.identical`, whose figure is the number of tensors that differ (gate == 0)."""
        t0, b0 = time.perf_counter(), self.digest.bytes
        bad: dict[str, list[str]] = {"build": list(self.build_mismatched), "engine": [], "reference": []}
        eng = self.engine_tensors()
        for name, want in self.engine_expected.items():
            t = eng.get(name)
            if t is None or self.digest(t, self.cast.get(name)) != want:
                bad["engine"].append(name)
        bad["engine"] += sorted(set(eng) - set(self.engine_expected))  # tensors nobody judged
        if self.reference_tensors is not None:
            ref = self.reference_tensors()
            for name, want in self.expected.items():
                if name not in ref or self.digest(ref[name], self.cast.get(name)) != want:
                    bad["reference"].append(name)
        names = list(dict.fromkeys(n for v in bad.values() for n in v))
        detail = (
            "; ".join(f"{n} ({', '.join(k for k, v in bad.items() if n in v)})" for n in names[:4])
            if names
            else f"{len(self.expected)} tensors, {self.mode}"
        )
        figures = {
            **self.describe(),
            "mismatched": names,
            "mismatched_by": {k: v for k, v in bad.items() if v},
            "bytes_hashed": self.digest.bytes,
            "check_bytes_hashed": self.digest.bytes - b0,
            "seconds": round(self.digest.seconds, 3),
            "check_seconds": round(time.perf_counter() - t0, 3),
        }
        check = Check("weights.identical", float(len(names)), "== 0 tensors differ", not names, detail)
        return [check], figures
