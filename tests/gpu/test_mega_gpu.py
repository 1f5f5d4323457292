"""The megakernel v0 on the H200 (skipped without an sm_90 GPU and nvcc): a chain of GEMV instructions
(e4m3 with block scales and bf16 weights, k of 512 / 2048 / 4096, the RMSNorm prologue, fp32 and bf16
outputs, sliced sources, more rows than chunks per CTA) matches the float64 reference of each
instruction from the x it read; a second launch gives the same bits under the next tag; a CUDA graph of
the launch replays with the tag advancing.

Tolerances (relative RMSE against float64): fp32 outputs of unnormalised x 1e-5 (fp32 accumulation);
through the RMSNorm prologue 2e-3 (a bf16 rounding of the normed x may flip against the reference's);
bf16 outputs 5e-3 (their own rounding, 2^-9 relative)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers import rel_rmse

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0)
                       or shutil.which("nvcc") is None, reason="needs an sm_90 GPU and nvcc"),
]


def _e4m3(rows, k, g):
    w = (torch.randn(rows, k, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    ws = 0.5 + 1.5 * torch.rand((rows + 127) // 128, k // 128, device="cuda", generator=g)
    return w, ws


def _bf16(shape, g, scale=1.0):
    return (torch.randn(shape, device="cuda", generator=g) * scale).to(torch.bfloat16)


def _program(seed=0):
    from metainfer.kernels.mega import program as P

    g = torch.Generator(device="cuda").manual_seed(seed)
    w0, s0 = _e4m3(4200, 2048, g)
    w1, s1 = _e4m3(2048, 512, g)
    w2, s2 = _e4m3(1000, 4096, g)
    w4, s4 = _e4m3(20001, 2048, g)
    instrs = [
        P.Gemv(w0, s0, x=_bf16(2048, g, 3.0), norm_w=_bf16(2048, g, 0.1), out_bf16=True),
        P.Gemv(w1, s1, src=0, src_off=100),
        P.Gemv(w2, s2, src=0),
        P.Gemv(_bf16((257, 2048), g, 0.05), src=0, norm_w=_bf16(2048, g, 0.1)),
        P.Gemv(w4, s4, src=0, src_off=2000, norm_w=_bf16(2048, g, 0.1), out_bf16=True, eps=1e-5),
    ]
    return P.Program(instrs)


@pytest.fixture(scope="module")
def kernel():
    from metainfer.kernels.mega.launch import MegaKernel

    return MegaKernel("cuda")


def _bits(prog):
    """Each instruction's output words without their tags (the value bits) [rows] int32."""
    return [y.view(torch.int32).view(-1, 2)[:, 0].clone() for y in prog.y]


def _check(prog):
    from metainfer.kernels.mega import program as P

    for i, g in enumerate(prog.instrs):
        got = prog.values(i).double()
        want = P.reference(g, prog.x_of(i))
        tol = 5e-3 if g.out_bf16 else (2e-3 if g.norm_w is not None else 1e-5)
        assert torch.isfinite(got).all(), i
        assert rel_rmse(got, want) < tol, (i, rel_rmse(got, want))


def test_chain_matches_reference(kernel):
    prog = _program()
    kernel.launch(prog)
    torch.cuda.synchronize()
    assert prog.step() == 1
    for i in range(len(prog.instrs)):
        assert bool((prog.tags(i) == 1).all()), i
    _check(prog)


def test_second_launch_same_bits_next_tag(kernel):
    prog = _program(seed=1)
    kernel.launch(prog)
    first = _bits(prog)
    kernel.launch(prog)
    torch.cuda.synchronize()
    assert prog.step() == 2
    for i, (a, b) in enumerate(zip(_bits(prog), first)):
        assert bool((prog.tags(i) == 2).all()) and torch.equal(a, b), i


def test_cuda_graph_replay(kernel):
    prog = _program(seed=2)
    kernel.launch(prog)  # eager: tag 1
    torch.cuda.synchronize()
    eager = _bits(prog)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            kernel.launch(prog)
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert prog.step() == 4  # eager 1, then 3 replays (capturing runs nothing)
    for i, (a, b) in enumerate(zip(_bits(prog), eager)):
        assert bool((prog.tags(i) == 4).all()) and torch.equal(a, b), i
