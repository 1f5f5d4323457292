"""Norm kernels vs the references (TRITON_INTERPRET on CPU): odd widths, strided head views."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import norm
from metainfer.kernels import reference as ref
from tests.helpers import rel_rmse

# (relative RMSE, max abs) vs the reference. bf16 is loose because the interpreter truncates
# fp32 -> bf16 casts (the GPU rounds to nearest; tests/gpu checks bf16 tightly).
TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (2e-2, 1e-1)}
DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    rr, ma = TOL[dtype]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_rmse(got, want) < rr, rel_rmse(got, want)
    assert (got.float() - want.float()).abs().max().item() < ma


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 7])
def test_rms_norm(T, dtype):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 48, generator=g).to(dtype)
    w = (torch.randn(48, generator=g) * 0.1).to(dtype)
    _close(norm.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_heads(dtype):
    """q = qg[..., :D] of a [T, H, 2D] projection: rows strided per token and per head."""
    g = torch.Generator().manual_seed(1)
    T, H, D = 5, 3, 24
    qg = torch.randn(T, H, 2 * D, generator=g).to(dtype)
    q = qg[..., :D]
    w = (torch.randn(D, generator=g) * 0.1).to(dtype)
    _close(norm.rms_norm(q, w, 1e-6), ref.rms_norm(q, w, 1e-6), dtype)
    kv = torch.randn(T, 3 * H * D, generator=g).to(dtype)
    k = torch.split(kv, [H * D, 2 * H * D], dim=-1)[0].view(T, H, D)
    _close(norm.rms_norm(k, w, 1e-6), ref.rms_norm(k, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 7])
def test_add_rms_norm(T, dtype):
    g = torch.Generator().manual_seed(10 + T)
    x = torch.randn(T, 48, generator=g).to(dtype)
    r = torch.randn(T, 48, generator=g).to(dtype)
    w = (torch.randn(48, generator=g) * 0.1).to(dtype)
    x0, r0 = x.clone(), r.clone()
    out, new_r = norm.add_rms_norm(x, r, w, 1e-6)
    want_out, want_r = ref.add_rms_norm(x, r, w, 1e-6)
    _close(new_r, want_r, dtype)
    _close(out, want_out, dtype)
    assert torch.equal(x, x0) and torch.equal(r, r0)
    xs = torch.randn(T, 80, generator=g).to(dtype)[:, 16:64]  # strided rows
    _close(norm.add_rms_norm(xs, r, w, 1e-6)[0], ref.add_rms_norm(xs, r, w, 1e-6)[0], dtype)
    out, same = norm.add_rms_norm(x, None, w, 1e-6)
    assert same is x
    _close(out, ref.rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N,E", [(1, 48, 9), (3, 100, 7), (8, 64, 33)])
def test_add_rms_norm_router(T, N, E, dtype, monkeypatch):
    """The norm and the MoE router's logits of its output in one launch: odd widths, a router not a
    multiple of the programs' rows, strided x rows; `router_ok` (the plan's check) refuses a router in
    another dtype and rows past the token bound, which the launcher then refuses too."""
    assert T <= norm.ROUTER_MAX_T
    g = torch.Generator().manual_seed(20 + T)
    x = torch.randn(T, N + 16, generator=g).to(dtype)[:, 8 : N + 8]
    r = torch.randn(T, N, generator=g).to(dtype)
    w = (torch.randn(N, generator=g) * 0.1).to(dtype)
    rw = (torch.randn(E, N, generator=g) / N**0.5).to(dtype)
    out, new_r, logits = norm.add_rms_norm_router(x, r, w, 1e-6, rw)
    want_out, want_r = ref.add_rms_norm(x, r, w, 1e-6)
    _close(new_r, want_r, dtype)
    _close(out, want_out, dtype)
    _close(logits, torch.nn.functional.linear(want_out, rw), dtype)
    assert norm.router_ok(T, dtype, dtype) and not norm.router_ok(T, dtype, torch.float64)
    with pytest.raises(AssertionError):
        norm.add_rms_norm_router(x, r, w, 1e-6, rw.double())  # a router in another dtype
    monkeypatch.setattr(norm, "ROUTER_BLOCK_E", 4)  # other rows a program: the same logits
    _close(norm.add_rms_norm_router(x, r, w, 1e-6, rw)[2], logits, dtype)
    monkeypatch.setattr(norm, "ROUTER_MAX_T", T - 1)
    assert not norm.router_ok(T, dtype, dtype)
    with pytest.raises(AssertionError):
        norm.add_rms_norm_router(x, r, w, 1e-6, rw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hv,Dv", [(1, 4, 16), (3, 3, 24), (7, 2, 16)])
def test_gated_rms_norm(T, Hv, Dv, dtype):
    g = torch.Generator().manual_seed(T * 100 + Dv)
    x = torch.randn(T, Hv, Dv, generator=g).to(dtype)
    zz = torch.randn(T, 2 * Hv * Dv, generator=g).to(dtype)
    z = zz[:, Hv * Dv :].view(T, Hv, Dv)  # strided rows, as split from the in_proj output
    w = (1 + 0.1 * torch.randn(Dv, generator=g)).to(dtype)
    _close(norm.gated_rms_norm(x, z, w, 1e-6), ref.gated_rms_norm(x, z, w, 1e-6), dtype)


def test_gated_rms_norm_fp32_weight_bf16_x():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 16, generator=g).bfloat16()
    z = torch.randn(3, 2, 16, generator=g).bfloat16()
    w = 1 + 0.1 * torch.randn(16, generator=g)
    want = ref.gated_rms_norm(x, z, w, 1e-6)
    _close(norm.gated_rms_norm(x, z, w, 1e-6), want, torch.bfloat16)


def test_registered():
    from metainfer.kernels import registry

    names = ("rms_norm", "add_rms_norm", "gated_rms_norm")
    assert registry.load(set(names)) == {n: getattr(norm, n) for n in names}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,W", [(1, 9), (3, 3)])
def test_moe_add_rms_norm(T, W, dtype):
    """The MoE's weighted sum of fp32 rows, the residual add and the norm in one launch."""
    g = torch.Generator().manual_seed(30 + T)
    rows = torch.randn(T, W, 48, generator=g)
    tw = torch.rand(T, W, generator=g)
    r = torch.randn(T, 48, generator=g).to(dtype)
    w = (torch.randn(48, generator=g) * 0.1).to(dtype)
    out, new_r = norm.moe_add_rms_norm(rows, tw, r, w, 1e-6)
    want_out, want_r = ref.add_rms_norm(ref.moe_combine(rows, tw, dtype), r, w, 1e-6)
    _close(new_r, want_r, dtype)
    _close(out, want_out, dtype)
    out, x = norm.moe_add_rms_norm(rows, tw, None, w, 1e-6, dtype)  # no residual yet
    want_x = ref.moe_combine(rows, tw, dtype)
    _close(x, want_x, dtype)
    _close(out, ref.rms_norm(want_x, w, 1e-6), dtype)


@pytest.mark.parametrize("moe_rows", [False, True])
def test_norm_writes_act_quant_copy(moe_rows):
    """xq_out (`fp8_linear.act_buffers`): the fused add+norm also writes its output's e4m3
    copy and per-128-column scales, the bits `fp8_linear.act_quant` gives for that output; the
    padding rows of the buffers (T = 5 -> 8 rows) stay zeros."""
    from metainfer.kernels import fp8_linear

    T, N, W = 5, 384, 3
    g = torch.Generator().manual_seed(3)
    res = torch.randn(T, N, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16)
    xq = fp8_linear.act_buffers(T, N, "cpu")
    if moe_rows:
        rows = torch.randn(T, W, N, generator=g)
        tw = torch.rand(T, W, generator=g)
        out, new_res = norm.moe_add_rms_norm(rows, tw, res, w, 1e-6, xq_out=xq)
        want = norm.moe_add_rms_norm(rows, tw, res, w, 1e-6)
    else:
        x = torch.randn(T, N, generator=g).to(torch.bfloat16) * 4
        out, new_res = norm.add_rms_norm(x, res, w, 1e-6, xq_out=xq)
        want = norm.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(out, want[0]) and torch.equal(new_res, want[1])
    q, s = fp8_linear.act_quant(out)
    assert torch.equal(xq[0][:T].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(xq[1][:, :T], s)
    assert not xq[0][T:].view(torch.uint8).any()


def test_gated_norm_writes_act_quant_copy():
    """xq_out on the DeltaNet gated norm: the e4m3 copy of its [T, Hv, Dv] output is act_quant's of the
    output viewed [T, Hv * Dv] (each head's row: Dv / 128 whole groups), padding rows zero."""
    from metainfer.kernels import fp8_linear

    T, Hv, Dv = 5, 3, 128
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, Hv, Dv, generator=g).to(torch.bfloat16) * 2
    z = torch.randn(T, 2 * Hv, Dv, generator=g).to(torch.bfloat16)[:, ::2]  # a strided head view
    w = (1 + 0.1 * torch.randn(Dv, generator=g)).to(torch.bfloat16)
    xq = fp8_linear.act_buffers(T, Hv * Dv, "cpu")
    out = norm.gated_rms_norm(x, z, w, 1e-6, xq_out=xq)
    assert torch.equal(out, norm.gated_rms_norm(x, z, w, 1e-6))
    q, s = fp8_linear.act_quant(out.view(T, Hv * Dv))
    assert torch.equal(xq[0][:T].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(xq[1][:, :T], s)
    assert not xq[0][T:].view(torch.uint8).any()
