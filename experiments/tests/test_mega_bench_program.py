"""experiments/mega_bench.py builds a program the megakernel accepts (program.check), on the CPU, for a
two-layer cut of the full config (one DeltaNet, one attention layer, a small vocabulary): every layer's
13 instructions with the step's shapes, each source the one the real step would wait for."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from metainfer.config import FULL, FULL_CONFIG, LINEAR, ModelConfig
from metainfer.kernels.mega import program as P

BENCH = Path(__file__).resolve().parents[2] / "experiments" / "mega_bench.py"


def _bench():
    spec = importlib.util.spec_from_file_location("mega_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("free", [False, True])
def test_two_layer_program_is_accepted(free):
    full = ModelConfig.from_hf(FULL_CONFIG)
    cfg = dataclasses.replace(full, num_hidden_layers=2, layer_types=(LINEAR, FULL), vocab_size=1000)
    instrs = _bench().build(cfg, "fp8", free=free, device="cpu")
    prog = P.Program(instrs)
    assert len(prog.instrs) == 2 * 13 + 1
    assert [g.rows for g in instrs[:4]] == [12352, 2048, 257, 9216]
    assert [g.k for g in instrs[:4]] == [2048, 4096, 2048, 2048] and instrs[13].rows == 9216
    assert instrs[2].w.dtype == torch.bfloat16 and instrs[-1].rows == 1000
    src = [g.x.index if isinstance(g.x, P.Src) else -1 for g in instrs]
    if not free:
        assert src[:5] == [-1, 0, 1, 1, 3] and instrs[12].x.off == 8 * 1024
        assert src[13] == 12 and src[-1] == 25  # the last down: the next residual stream
    else:
        assert all(isinstance(g.x, P.Vec) for g in instrs)
