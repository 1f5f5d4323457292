"""The real kernels `metainfer loop tune` sweeps (CUDA only).

fp8_skinny: the FP8 weight-streaming (decode) linear, `weight_stream.stream_linear`, at the model's dense
projections for T tokens, timed by benchmarks/kernels_b.py's `LinearCase` (CUDA graphs over rotating
weight copies) and checked there against F.linear on the dequantised weights. Its table is
metainfer/kernels/fp8_skinny_<gpu>.json, keyed "N,K,T" (the format `weight_stream.tuned_table` reads).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def gpu_slug(gpu: str) -> str:
    """ "NVIDIA H200" -> "h200": the GPU part of a tuned table's file name, as the kernels read it."""
    from metainfer.kernels import ops

    return ops.gpu_slug(gpu)


class Fp8Skinny:
    name = "fp8_skinny"
    tolerance = 1e-2  # relative RMSE against F.linear on the dequantised weights (bf16 output)

    def __init__(self, tokens: tuple[int, ...] = (1,), linears: tuple[str, ...] = ()) -> None:
        import torch

        sys.path.insert(0, str(REPO / "benchmarks"))
        import kernels_b

        self._kb = kernels_b
        names = linears or tuple(kernels_b.LINEARS)
        unknown = [n for n in names if n not in kernels_b.LINEARS]
        if unknown:
            raise ValueError(f"unknown linear(s) {', '.join(unknown)}; known: {', '.join(kernels_b.LINEARS)}")
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.shapes = {
            f"{N},{K},{T}": (n, N, K, T) for n in names for (N, K) in [kernels_b.LINEARS[n]] for T in tokens
        }
        self._cases: dict[str, object] = {}

    def table(self, gpu: str) -> str:
        return f"metainfer/kernels/fp8_skinny_{gpu_slug(gpu)}.json"

    def keys(self) -> list[str]:
        """The shapes whose projection runs this kernel: not those the table sends to the GEMV kernel."""
        table = self._kb.ws.tuned_table()
        return [k for k in self.shapes if f"gemv:{k}" not in table]

    def default(self, key: str) -> dict:
        """The engine's config today: the committed table's, else the heuristic (through the benchmark's
        own handle on the kernel module)."""
        _, N, K, T = self.shapes[key]
        return self._kb.ws.skinny_config(T, N, K, self.sms)

    def candidates(self, key: str) -> list[dict]:
        import triton

        _, N, K, T = self.shapes[key]
        out = []
        for bn, bk, mult, stages in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4), (3, 5)):
            if T > 1 and bk > 256:
                continue
            k_iters = triton.cdiv(K, bk)
            per = triton.cdiv(k_iters, max(1, min(k_iters, mult * self.sms // triton.cdiv(N, bn))))
            out.append(
                dict(
                    self.default(key),
                    BLOCK_N=bn,
                    BLOCK_K=bk,
                    SPLIT_K=triton.cdiv(k_iters, per),
                    iters_per_split=per,
                    STAGES=stages,
                )
            )
        return out

    def measure(self, key: str, config: dict) -> tuple[float, float]:
        name, N, K, T = self.shapes[key]
        case = self._cases.get(name)
        if case is None:
            case = self._cases[name] = self._kb.LinearCase(name, N, K)
        r = case.run(T, cfg=config, eager=False)
        return float(r["us"]), float(r["rel_err"])
