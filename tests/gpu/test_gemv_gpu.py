"""The FP8 wgmma projection of one token (metainfer/kernels/mega/gemv.cu, KB-0094) on the H200 (skipped
without an sm_90 GPU and nvcc): against a float64 reference of the dequantised weights, against the Triton
path it replaces (`fp8_linear` with the switch off), inside a CUDA graph, and in a PDL chain after a Triton
kernel that writes its input (the wait before reading x).

Tolerance (relative RMSE): 5e-3 against float64 (bf16 outputs: 2^-9 rounding; x's two e4m3 terms are exact for
bf16 down to 2^-9 of each 128-column block's largest), 8e-3 against the Triton path (both rounded to bf16)."""

from __future__ import annotations

import shutil

import pytest
import torch

from metainfer.kernels import fp8_linear, norm, pdl
from metainfer.kernels.mega import gemv
from metainfer.model.fp8 import quantize_fp8_block
from tests.helpers import rel_rmse

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0)
                       or shutil.which("nvcc") is None, reason="needs an sm_90 GPU and nvcc"),
]


def _problem(n: int, seed: int = 0, k: int = gemv.K):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w32 = torch.randn(n, k, generator=g, device="cuda") * 0.05
    w, s = quantize_fp8_block(w32)
    x = (torch.randn(1, k, generator=g, device="cuda") * 2).to(torch.bfloat16)
    return x, w, s


def _reference(x, w, s):
    deq = w.double() * s.double().repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)
    return (x.double() @ deq.T).float()


@pytest.mark.parametrize("n", [16, 144, 9216, 12352])
def test_matches_float64_and_the_triton_path(n, monkeypatch):
    x, w, s = _problem(n)
    monkeypatch.setenv(gemv.ENV, "1")
    assert gemv.wanted(x, w, s)
    got = fp8_linear.fp8_linear(x, w, s)
    monkeypatch.setenv(gemv.ENV, "0")
    triton_y = fp8_linear.fp8_linear(x, w, s)
    want = _reference(x, w, s)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    assert rel_rmse(got.float(), want) < 5e-3
    assert rel_rmse(got.float(), triton_y.float()) < 8e-3


@pytest.mark.parametrize("n", [8, 136, 2048])
def test_k4096_matches_float64_and_the_triton_path(n, monkeypatch):
    """K = 4,096 (8-row chunks, wgmma m64n16k32; the attention o_proj), with METAINFER_WGMMA_GEMV_K4096=1."""
    x, w, s = _problem(n, seed=3, k=gemv.K_WIDE)
    monkeypatch.setenv(gemv.ENV, "1")
    monkeypatch.delenv(gemv.K4096_ENV, raising=False)
    assert not gemv.wanted(x, w, s)  # off by default
    monkeypatch.setenv(gemv.K4096_ENV, "1")
    assert gemv.wanted(x, w, s)
    got = fp8_linear.fp8_linear(x, w, s)
    monkeypatch.setenv(gemv.ENV, "0")
    triton_y = fp8_linear.fp8_linear(x, w, s)
    assert rel_rmse(got.float(), _reference(x, w, s)) < 5e-3
    assert rel_rmse(got.float(), triton_y.float()) < 8e-3


def test_gated_norm_out_proj(monkeypatch):
    """The DeltaNet out_proj with its gated RMSNorm as the K = 4,096 form's x prologue
    (METAINFER_WGMMA_GEMV_GNORM=1), against float64 (the bf16 norm from reference.gated_rms_norm) and the
    Triton `gated_norm_linear`."""
    from metainfer.kernels import reference, weight_stream

    _, w, s = _problem(2048, seed=4, k=gemv.K_WIDE)
    g = torch.Generator(device="cuda").manual_seed(5)
    proj = torch.randn(1, 40, 128, generator=g, device="cuda").to(torch.bfloat16)
    core, z = torch.randn(1, 32, 128, generator=g, device="cuda").to(torch.bfloat16), proj[:, 8:]  # z: a view
    nw = (1 + 0.1 * torch.randn(128, generator=g, device="cuda")).to(torch.bfloat16)
    monkeypatch.setenv(gemv.ENV, "1")
    monkeypatch.setenv(gemv.GNORM_ENV, "0")
    triton_y = weight_stream.gated_norm_linear(core, z, nw, 1e-6, w, s)
    monkeypatch.setenv(gemv.GNORM_ENV, "1")
    assert gemv.wanted_gnorm(core, z, nw, w, s)
    got = weight_stream.gated_norm_linear(core, z, nw, 1e-6, w, s)
    x = reference.gated_rms_norm(core, z, nw, 1e-6).reshape(1, gemv.K_WIDE)
    assert rel_rmse(got.float(), _reference(x, w, s)) < 8e-3
    assert rel_rmse(got.float(), triton_y.float()) < 8e-3


def test_not_wanted_off_its_shapes(monkeypatch):
    monkeypatch.setenv(gemv.ENV, "1")
    x, w, s = _problem(144)
    assert not gemv.wanted(x.float(), w, s)  # bf16 x only
    assert not gemv.wanted(torch.cat([x, x]), w, s)  # one token
    w2, s2 = quantize_fp8_block(torch.randn(136, gemv.K, device="cuda"))
    assert not gemv.wanted(x, w2, s2)  # N a multiple of 16
    monkeypatch.setenv(gemv.ENV, "0")
    assert not gemv.wanted(x, w, s)


def test_graph_replay_and_pdl_chain(monkeypatch):
    """An RMSNorm (Triton, PDL) writes x, the projection reads it: eager, then captured in a graph and
    replayed with a new input; the same bits both ways."""
    monkeypatch.setenv(gemv.ENV, "1")
    _, w, s = _problem(9216, seed=1)
    src = torch.randn(1, gemv.K, device="cuda").to(torch.bfloat16)
    nw = torch.randn(gemv.K, device="cuda").to(torch.bfloat16)

    def step():
        return fp8_linear.fp8_linear(norm.rms_norm(src, nw, 1e-6), w, s)

    assert pdl.enabled()
    eager = step()
    assert rel_rmse(eager.float(), _reference(norm.rms_norm(src, nw, 1e-6), w, s)) < 5e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    src.copy_(torch.randn(1, gemv.K, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())


@pytest.mark.parametrize("has", [True, False])
def test_conv_epilogue_matches_the_triton_path(has, monkeypatch):
    """The DeltaNet in_proj with its decode conv (`linear_conv_update`): output and conv state against the
    Triton kernel's epilogue (both bf16; the projections' sums differ in order, so a bf16 step here and
    there)."""
    from metainfer.kernels import weight_stream

    C, S = 8192, 5
    x, w, s = _problem(12352, seed=2)
    cw = (torch.randn(C, 4, device="cuda") * 0.5).to(torch.bfloat16)
    state = torch.randn(S, 3, C, device="cuda").to(torch.bfloat16)
    slots = torch.tensor([3], device="cuda")
    has_state = torch.tensor([has], device="cuda")
    ref_state = state.clone()
    monkeypatch.setenv(gemv.ENV, "0")
    want = weight_stream.linear_conv_update(x, w, s, cw, ref_state, slots, has_state)
    monkeypatch.setenv(gemv.ENV, "1")
    monkeypatch.delenv(gemv.CONV_ENV, raising=False)
    assert gemv.wanted_conv(x, w, s, cw, state, slots)  # on by default (KB-0095)
    got = weight_stream.linear_conv_update(x, w, s, cw, state, slots, has_state)
    assert rel_rmse(got[:, :C].float(), want[:, :C].float()) < 8e-3  # the conv's columns
    assert rel_rmse(got[:, C:].float(), want[:, C:].float()) < 8e-3  # z, b, a: the projection alone
    assert rel_rmse(state.float(), ref_state.float()) < 8e-3
    assert torch.equal(state[:3], ref_state[:3]) and torch.equal(state[4:], ref_state[4:])  # other slots
    assert torch.equal(state[3, :2], ref_state[3, :2])  # the shifted rows: copies (zeros without a state)
