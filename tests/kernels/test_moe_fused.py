"""The fused decode MoE block (`moe_fused`: routing, gate/up, down and the weighted sum in one launch,
summed in int64 fixed point) and its consumer norm, on the Triton interpreter.

Shapes as tests/kernels/test_moe.py (H=160: two FP8 column blocks, the second ragged; I=48: no
multiple of any I-block; E=8, k=2), T = 1, 3. The reference is `reference.moe_expert_rows` (the
activation rounded to x's dtype, outputs fp32) summed with `reference.route(_with_shared)`'s weights
in fp32 (`reference.moe_combine`), i.e. the block's output before its rounding to x's dtype.
Tolerances (relative RMSE; max-abs relative to max |ref|): fp32 operands 1e-5 / 1e-4 (the fixed
point's 2^-32 steps are far below); bf16 1.5e-2 / 3e-2 as test_moe.py's (the interpreter truncates
fp32 -> bf16); FP8 weights against the dequantised weights: the same.
"""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import moe_fused, norm, ops
from metainfer.kernels import reference as ref
from metainfer.kernels.ops import ref_dequant_fp8
from metainfer.model.fp8 import quantize_fp8_block
from tests.helpers import rel_rmse

H, I, E, K = 160, 48, 8, 2
F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: (1e-5, 1e-4), BF16: (1.5e-2, 3e-2)}
# odd tilings: a ragged last I-block (48 = 32 + 16), H split in two uneven halves (96 + 64 of 160)
CONFIGS = [
    dict(BLOCK_I=32, BLOCK_K=64, BLOCK_H=32, H_SPLIT=2, STAGES=2, num_warps=4, MMA=0),
    dict(BLOCK_I=16, BLOCK_K=128, BLOCK_H=64, H_SPLIT=1, STAGES=2, num_warps=4, MMA=1, DOT_F16=1),
]


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _problem(T: int, dtype, shared: bool, fp8: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = E + int(shared)
    x = torch.randn(T, H, generator=g).to(dtype)
    w_gu = (torch.randn(n, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w_dn = (torch.randn(n, H, I, generator=g) / I**0.5).to(dtype)
    logits = (torch.randn(T, n + 1, generator=g) * 3).to(dtype)[:, :n]  # strided rows, as the router's split
    tw, ids = (ref.route_with_shared if shared else ref.route)(logits, K)
    args, ref_w = (w_gu, w_dn), (w_gu, w_dn)
    if fp8:
        (q_gu, s_gu), (q_dn, s_dn) = quantize_fp8_block(w_gu), quantize_fp8_block(w_dn)
        args = (q_gu, q_dn, s_gu, s_dn)
        ref_w = (ref_dequant_fp8(q_gu, s_gu, dtype), ref_dequant_fp8(q_dn, s_dn, dtype))
    want = ref.moe_combine(ref.moe_expert_rows(x, *ref_w, ids), tw, torch.float32)  # [T, H] fp32
    return x, logits, args, want


def _value(acc: torch.Tensor) -> torch.Tensor:
    return (acc.double() / moe_fused.FIXED_POINT_SCALE).float()


@pytest.mark.parametrize("cfg", CONFIGS, ids=["cuda-cores", "mma"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("T,dtype", [(1, F32), (3, F32), (3, BF16)])
def test_moe_fused_sum(T, dtype, shared, fp8, cfg):
    x, logits, args, want = _problem(T, dtype, shared, fp8, seed=T)
    acc = torch.zeros(T, H, dtype=torch.int64)
    got = moe_fused.moe_fused_sum(x, logits, K, shared, *args, config=cfg, acc=acc)
    assert got is acc and acc.dtype == torch.int64
    rmse, max_abs = TOL[dtype]
    assert rel_rmse(_value(acc), want) < rmse and _max_rel(_value(acc), want) < max_abs


def test_moe_fused_sum_adds_exactly():
    """The shares are summed in integers: a second launch onto the same accumulator adds exactly
    the first's sum again (acc = 2 * first, bit for bit), and a fresh launch gives the same bits."""
    x, logits, args, _ = _problem(3, F32, True, True, seed=5)
    first = moe_fused.moe_fused_sum(x, logits, K, True, *args, config=CONFIGS[0],
                                    acc=torch.zeros(3, H, dtype=torch.int64))
    again = moe_fused.moe_fused_sum(x, logits, K, True, *args, config=CONFIGS[1],
                                    acc=torch.zeros(3, H, dtype=torch.int64))
    twice = moe_fused.moe_fused_sum(x, logits, K, True, *args, config=CONFIGS[0], acc=first.clone())
    assert torch.equal(twice, 2 * first)
    assert rel_rmse(_value(again), _value(first)) < 1e-5  # another tiling: other fp32 shares


def test_moe_fused_sum_asserts():
    x, logits, args, _ = _problem(2, F32, False, True)
    more = (torch.cat([args[0], args[0][:1]]), torch.cat([args[1], args[1][:1]]),
            torch.cat([args[2], args[2][:1]]), torch.cat([args[3], args[3][:1]]))
    with pytest.raises(AssertionError):  # the logits say E experts, the weights E + 1 with a shared one
        moe_fused.moe_fused_sum(x, logits, K, True, *more, acc=torch.zeros(2, H, dtype=torch.int64))
    with pytest.raises(AssertionError):  # FP8 tiles must not straddle a 128-block
        moe_fused.moe_fused_sum(x, logits, K, False, *args, config=dict(CONFIGS[0], BLOCK_I=48),
                                acc=torch.zeros(2, H, dtype=torch.int64))
    with pytest.raises(AssertionError):  # a float accumulator
        moe_fused.moe_fused_sum(x, logits, K, False, *args, acc=torch.zeros(2, H))


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("T", [1, 3])
def test_moe_acc_add_rms_norm(T, dtype):
    """The consumer: x = acc / 2^32 rounded to the residual's dtype, the residual add and the norm in
    one launch, which leaves the accumulator zeroed; with no residual (layer 0) x is the new residual."""
    g = torch.Generator().manual_seed(40 + T)
    val = torch.randn(T, 48, generator=g) * 3
    acc = (val.double() * moe_fused.FIXED_POINT_SCALE).to(torch.int64)
    r = torch.randn(T, 48, generator=g).to(dtype)
    w = (torch.randn(48, generator=g) * 0.1).to(dtype)
    x = _value(acc).to(dtype)
    out, new_r = norm.moe_acc_add_rms_norm(acc.clone(), r, w, 1e-6)
    want_out, want_r = ref.add_rms_norm(x, r, w, 1e-6)
    tol = 1e-6 if dtype == F32 else 2e-2
    assert torch.allclose(new_r.float(), want_r.float(), rtol=tol, atol=tol)
    assert torch.allclose(out.float(), want_out.float(), rtol=tol, atol=tol)
    buf = acc.clone()
    out, x2 = norm.moe_acc_add_rms_norm(buf, None, w, 1e-6, dtype)
    assert torch.allclose(x2.float(), x.float(), rtol=tol, atol=0) and not buf.any()  # (bf16: truncated)
    assert torch.allclose(out.float(), ref.rms_norm(x, w, 1e-6).float(), rtol=tol, atol=tol)


def test_ops_reference_consumer_zeroes_too():
    """ops.moe_acc_add_rms_norm on the CPU (no kernels): the same contract through the reference."""
    acc = (torch.randn(2, 48).double() * moe_fused.FIXED_POINT_SCALE).to(torch.int64)
    r = torch.randn(2, 48)
    w = torch.randn(48) * 0.1
    want = ref.add_rms_norm(_value(acc), r, w, 1e-6)
    got = ops.moe_acc_add_rms_norm(acc, r, w, 1e-6)
    assert all(torch.allclose(a, b) for a, b in zip(got, want)) and not acc.any()


def test_fused_switch_and_bound(monkeypatch):
    """Off unless METAINFER_MOE_FUSED=1; then T up to METAINFER_MOE_FUSED_MAX_T (default 4); ops
    serves only CUDA tensors (None here, on the CPU)."""
    monkeypatch.delenv(moe_fused.ENV, raising=False)
    monkeypatch.delenv(moe_fused.MAX_T_ENV, raising=False)
    assert not moe_fused.fused_ok(1)
    monkeypatch.setenv(moe_fused.ENV, "1")
    assert moe_fused.fused_ok(moe_fused.FUSED_MAX_T) and not moe_fused.fused_ok(moe_fused.FUSED_MAX_T + 1)
    assert not moe_fused.fused_ok(0)
    monkeypatch.setenv(moe_fused.MAX_T_ENV, "1")
    assert moe_fused.fused_ok(1) and not moe_fused.fused_ok(2)
    x, logits, args, _ = _problem(1, F32, True, True)
    assert ops.moe_fused_sum(x, logits, K, True, *args) is None
