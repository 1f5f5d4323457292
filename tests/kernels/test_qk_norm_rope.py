"""Fused q/k norm + RoPE + KV write vs the reference composition (interpreter on the CPU).
Tolerances: fp32 rel RMSE < 1e-5; bf16 < 1e-2 (the kernel rounds once, the reference three times)."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import ops
from metainfer.kernels import reference as ref
from metainfer.kernels.qk_norm_rope import qk_norm_rope_write
from tests.helpers import rel_rmse


@pytest.mark.parametrize("T,dtype", [(1, torch.float32), (7, torch.float32), (5, torch.bfloat16)])
def test_matches_reference(T, dtype):
    g = torch.Generator().manual_seed(T)
    Hq, Hkv, D, rd, bs, N = 4, 2, 32, 8, 4, 6
    qg = torch.randn(T, Hq, 2 * D, generator=g).to(dtype)  # q is a strided view, as in the model
    q, k, v = (
        qg[..., :D],
        torch.randn(T, Hkv, D, generator=g).to(dtype),
        torch.randn(T, Hkv, D, generator=g).to(dtype),
    )
    wq, wk = (
        (torch.rand(D, generator=g) * 0.2 - 0.1).to(dtype),
        (torch.rand(D, generator=g) * 0.2 - 0.1).to(dtype),
    )
    pos = torch.randint(0, 5000, (T,), generator=g)
    inv = ref.rope_inv_freq(rd, 1e7)
    slots = torch.randperm(N * bs, generator=g)[:T]
    kc1, vc1 = torch.zeros(N, bs, Hkv, D, dtype=dtype), torch.zeros(N, bs, Hkv, D, dtype=dtype)
    kc2, vc2 = kc1.clone(), vc1.clone()
    got = qk_norm_rope_write(q, k, v, wq, wk, 1e-6, pos, inv, kc1, vc1, slots)
    want = ops.qk_norm_rope_write(q, k, v, wq, wk, 1e-6, pos, inv, kc2, vc2, slots)  # CPU: reference
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_rmse(got, want) < tol
    assert rel_rmse(kc1, kc2) < tol and torch.equal(vc1, vc2)
    untouched = torch.ones(N * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not kc1.view(N * bs, -1)[untouched].any()
