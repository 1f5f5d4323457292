"""gdn_decode kernel vs the recurrent reference (TRITON_INTERPRET on CPU), incl. the in-place state."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import gdn_decode as gdn
from metainfer.kernels import reference as ref
from tests.helpers import rel_rmse

# (relative RMSE, max abs) for the output; the fp32 state gets the fp32 pair.
# bf16 is loose: the interpreter truncates fp32 -> bf16 casts.
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 5e-2)}


def _reference(q, k, v, g, beta, state, slots, has):
    init = state[slots] * has[:, None, None, None].float()
    out, final = ref.gated_delta_rule_recurrent(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], init
    )
    state = state.clone()
    state[slots] = final
    return out[:, 0], state


def _inputs(B, Hk, Hv, Dk, Dv, S, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, 2 * Hk * Dk + Hv * Dv, generator=gen).to(dtype)  # strided views, as in the model
    q, k, v = torch.split(qkv, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q, k, v = q.view(B, Hk, Dk), k.view(B, Hk, Dk), v.view(B, Hv, Dv)
    g = -torch.rand(B, Hv, generator=gen) * 2
    beta = torch.rand(B, Hv, generator=gen).to(dtype)
    state = torch.randn(S, Hv, Dk, Dv, generator=gen) * 0.5
    slots = torch.randperm(S, generator=gen)[:B]
    has = torch.rand(B, generator=gen) > 0.3
    has[0] = True
    if B > 1:
        has[1] = False
    return q, k, v, g, beta, state, slots, has


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,Hk,Hv,Dk,Dv", [(1, 2, 4, 16, 16), (3, 1, 2, 16, 24), (5, 2, 2, 8, 16)])
def test_gdn_decode(B, Hk, Hv, Dk, Dv, dtype):
    q, k, v, g, beta, state, slots, has = _inputs(B, Hk, Hv, Dk, Dv, S=7, dtype=dtype, seed=B * 31 + Dv)
    want, want_state = _reference(q, k, v, g, beta, state, slots, has)
    got = gdn._launch(q, k, v, g, beta, state, slots, has, block_v=8, num_warps=1)
    rr, ma = TOL[dtype]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_rmse(got, want) < rr and (got.float() - want.float()).abs().max() < ma
    assert rel_rmse(state, want_state) < 1e-5 and (state - want_state).abs().max() < 1e-4
    others = torch.ones(state.shape[0], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(state[others], want_state[others])


def test_gdn_decode_default_launcher():
    q, k, v, g, beta, state, slots, has = _inputs(2, 2, 4, 16, 16, S=3, dtype=torch.float32, seed=9)
    want, want_state = _reference(q, k, v, g, beta, state, slots, has)
    got = gdn.gdn_decode(q, k, v, g, beta, state, slots, has)
    assert rel_rmse(got, want) < 1e-5 and rel_rmse(state, want_state) < 1e-5


def test_registered():
    from metainfer.kernels import registry

    assert registry.load({"gdn_decode"}) == {"gdn_decode": gdn.gdn_decode}


def test_gated_variant_matches_reference_gating():
    """The gating folded into the kernel (the state block read before the PDL wait): the reference's."""
    from metainfer.kernels import ops
    from metainfer.kernels.gdn_decode import gdn_decode_gated

    g = torch.Generator().manual_seed(11)
    B, Hk, Hv, Dk, Dv, S = 3, 2, 4, 16, 8, 5
    q, k = torch.randn(B, Hk, Dk, generator=g), torch.randn(B, Hk, Dk, generator=g)
    v = torch.randn(B, Hv, Dv, generator=g)
    ab = torch.randn(B, 2 * Hv + 3, generator=g) * 3  # strided views, as split from in_proj
    a, b = ab[:, :Hv], ab[:, Hv : 2 * Hv]
    A_log, dt_bias = torch.rand(Hv, generator=g) * 2, torch.rand(Hv, generator=g)
    slots, has = torch.tensor([4, 1, 2]), torch.tensor([True, False, True])
    s1 = torch.randn(S, Hv, Dk, Dv, generator=g)
    s2 = s1.clone()
    got = gdn_decode_gated(q, k, v, a, b, A_log, dt_bias, s1, slots, has)
    want = ops.gdn_decode_gated(q, k, v, a, b, A_log, dt_bias, s2, slots, has)  # CPU: reference
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5) and torch.allclose(s1, s2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("recurrent", [False, True])
def test_bf16_state_storage(recurrent):
    """--ssm-state-dtype bfloat16: the kernels read the bf16 state, update it in fp32 and store it
    rounded; the same as the fp32-state update of the bf16-rounded state, rounded (rel. RMSE < 1e-2:
    the interpreter truncates fp32 -> bf16 where the GPU and torch round), and the reference path
    (`ops.gdn_decode` on the CPU) takes bf16 storage the same way."""
    from metainfer.kernels import ops

    B, Hk, Hv, Dk, Dv, S = 3, 2, 4, 16, 16, 5
    q, k, v, g, beta, state, slots, has = _inputs(B, Hk, Hv, Dk, Dv, S=S, dtype=torch.float32, seed=77)
    s16 = state.to(torch.bfloat16)
    want, want_state = _reference(q, k, v, g, beta, s16.float(), slots, has)
    got_state = s16.clone()
    if recurrent:  # one token per sequence through the short-chunk kernel
        cu = torch.arange(B + 1, dtype=torch.int32)
        got = torch.empty(B, Hv, Dv)
        gdn.gdn_recurrent_varlen(q, k, v, g, beta, cu, got_state, slots, has, got)
    else:
        got = gdn._launch(q, k, v, g, beta, got_state, slots, has, block_v=8, num_warps=1)
    assert got_state.dtype == torch.bfloat16 and rel_rmse(got, want) < 1e-5
    assert rel_rmse(got_state.float(), want_state) < 1e-2
    ref_state = s16.clone()
    ref_out = ops.gdn_decode(q, k, v, g, beta, ref_state, slots, has)
    assert ref_state.dtype == torch.bfloat16 and rel_rmse(ref_out, want) < 1e-5
    assert torch.equal(ref_state.float(), want_state.to(torch.bfloat16).float())
