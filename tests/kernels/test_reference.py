"""The PyTorch references agree with each other (chunked vs recurrent, batched vs per-sequence)."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import reference as ref
from tests.helpers import rel_rmse


@pytest.mark.parametrize("L", [1, 5, 63, 64, 65, 130])
def test_chunked_matches_recurrent(L):
    g = torch.Generator().manual_seed(L)
    Hk, Hv, Dk, Dv = 2, 4, 16, 8
    q, k = torch.randn(L, Hk, Dk, generator=g), torch.randn(L, Hk, Dk, generator=g)
    v = torch.randn(L, Hv, Dv, generator=g)
    gdec = -torch.rand(L, Hv, generator=g) * 3
    beta = torch.rand(L, Hv, generator=g)
    s0 = torch.randn(Hv, Dk, Dv, generator=g)
    o1, s1 = ref.gated_delta_rule_chunked(q, k, v, gdec, beta, s0, chunk=16)
    o2, s2 = ref.gated_delta_rule_recurrent(q[None], k[None], v[None], gdec[None], beta[None], s0[None])
    assert rel_rmse(o1, o2[0]) < 1e-5 and rel_rmse(s1, s2[0]) < 1e-5


def test_conv_update_matches_sequence_conv():
    g = torch.Generator().manual_seed(0)
    C, K, L = 12, 4, 9
    w = torch.randn(C, K, generator=g)
    x = torch.randn(L, C, generator=g)
    state_a = torch.zeros(2, K - 1, C)
    full = ref.causal_conv1d(x, state_a, w, [0, L], [1], [False])
    state_b = torch.zeros(2, K - 1, C)
    steps = [
        ref.causal_conv1d_update(x[i : i + 1], state_b, w, torch.tensor([1]), torch.tensor([i > 0]))
        for i in range(L)
    ]
    assert torch.allclose(full, torch.cat(steps), atol=1e-5)
    assert torch.allclose(state_a, state_b)


def test_paged_attention_matches_dense():
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, D, bs = 4, 2, 8, 4
    n = 11
    k = torch.randn(n, Hkv, D, generator=g)
    v = torch.randn(n, Hkv, D, generator=g)
    q = torch.randn(n, Hq, D, generator=g)
    table = torch.tensor([5, 2, 7], dtype=torch.int32)
    kc = torch.zeros(8, bs, Hkv, D)
    vc = torch.zeros(8, bs, Hkv, D)
    for i in range(n):
        kc[table[i // bs], i % bs] = k[i]
        vc[table[i // bs], i % bs] = v[i]
    out = ref.paged_attention(q[-3:], kc, vc, table[None], [0, 3], [n], D**-0.5)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
        scale=D**-0.5,
    ).transpose(0, 1)
    assert torch.allclose(out, dense[-3:], atol=1e-5)
