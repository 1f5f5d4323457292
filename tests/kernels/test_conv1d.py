"""causal_conv1d_update kernel vs the reference (TRITON_INTERPRET on CPU), incl. the in-place state."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import conv1d
from metainfer.kernels import reference as ref
from tests.helpers import rel_rmse

# (relative RMSE, max abs); bf16 is loose: the interpreter truncates fp32 -> bf16 casts
TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (2e-2, 1e-1)}


def _inputs(B, C, K, S, dtype, seed, strided_x=False):
    g = torch.Generator().manual_seed(seed)
    xx = torch.randn(B, 2 * C + 3, generator=g).to(dtype)
    x = xx[:, 3 : 3 + C] if strided_x else xx[:, :C].contiguous()
    state = torch.randn(S, K - 1, C, generator=g).to(dtype)
    w = (torch.randn(C, K, generator=g) * 0.5).to(dtype)
    slots = torch.randperm(S, generator=g)[:B]
    has = torch.rand(B, generator=g) > 0.3
    has[0] = True
    if B > 1:
        has[1] = False
    return x, state, w, slots, has


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,C,K", [(1, 40, 4), (3, 700, 4), (5, 33, 3)])
def test_conv1d_update(B, C, K, dtype):
    x, state, w, slots, has = _inputs(B, C, K, S=7, dtype=dtype, seed=B * C, strided_x=B == 3)
    want_state = state.clone()
    want = ref.causal_conv1d_update(x, want_state, w, slots, has)
    got = conv1d.causal_conv1d_update(x, state, w, slots, has)
    rr, ma = TOL[dtype]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_rmse(got, want) < rr and (got.float() - want.float()).abs().max() < ma
    assert torch.equal(state, want_state)  # state moves are exact copies (untouched slots too)


def test_conv1d_update_steps_match_sequence_conv():
    """Several single-token steps from a fresh slot equal the whole-sequence conv."""
    g = torch.Generator().manual_seed(3)
    C, K, L = 24, 4, 6
    w = torch.randn(C, K, generator=g)
    x = torch.randn(L, C, generator=g)
    state_ref = torch.randn(3, K - 1, C, generator=g)
    state = state_ref.clone()
    full = ref.causal_conv1d(x, state_ref, w, [0, L], [2], [False])
    slot = torch.tensor([2])
    steps = [conv1d.causal_conv1d_update(x[i : i + 1], state, w, slot, torch.tensor([i > 0]))
             for i in range(L)]
    assert rel_rmse(torch.cat(steps), full) < 1e-6
    assert torch.allclose(state, state_ref)


def test_registered():
    from metainfer.kernels import registry

    assert registry.load({"causal_conv1d_update"}) == {"causal_conv1d_update": conv1d.causal_conv1d_update}


def test_conv1d_update_in_place_into_strided_rows():
    """out = x itself, a strided block of a wider projection output (the in_proj fallback)."""
    B, C, K = 3, 40, 4
    g = torch.Generator().manual_seed(9)
    proj = torch.randn(B, 2 * C, generator=g)
    x = proj[:, :C]
    state = torch.randn(5, K - 1, C, generator=g)
    w = torch.randn(C, K, generator=g) * 0.5
    slots, has = torch.tensor([4, 0, 2]), torch.tensor([True, False, True])
    want_state, tail = state.clone(), proj[:, C:].clone()
    want = ref.causal_conv1d_update(x.clone(), want_state, w, slots, has)
    got = conv1d.causal_conv1d_update(x, state, w, slots, has, out=x)
    assert got.data_ptr() == proj.data_ptr() and rel_rmse(proj[:, :C], want) < 1e-6
    assert torch.equal(proj[:, C:], tail) and rel_rmse(state, want_state) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [4, 2])
def test_prefill_varlen_matches_reference(K, dtype):
    """The varlen prefill kernel: four sequences of 1, 2, 37 and 70
    tokens (shorter than the state, than a 32-token block, several blocks) over 200 channels (a
    ragged 128-wide block) of strided rows, with and without state; outputs and the updated
    states against `reference.causal_conv1d`, other slots untouched."""
    g = torch.Generator().manual_seed(5)
    lens, C, S = [1, 2, 37, 70], 200, 7
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    xx = torch.randn(qsl[-1], C + 9, generator=g).to(dtype)
    x = xx[:, 9:]
    state = torch.randn(S, K - 1, C, generator=g).to(dtype)
    w = (torch.randn(C, K, generator=g) * 0.5).to(dtype)
    slots, has = [5, 0, 3, 6], [True, True, False, True]
    state0, want_state = state.clone(), state.clone()
    want = ref.causal_conv1d(x, want_state, w, qsl, slots, has)
    got = conv1d.causal_conv1d(x, state, w, qsl, slots, has, torch.tensor(qsl, dtype=torch.int32),
                               torch.tensor(slots), torch.tensor(has))
    rmse, max_abs = TOL[dtype]
    assert rel_rmse(got, want) < rmse and (got.float() - want.float()).abs().max() < max_abs
    assert torch.equal(state, want_state)  # the new states are copies of inputs: exact
    # without the device offsets: the reference itself
    assert torch.equal(conv1d.causal_conv1d(x, state0, w, qsl, slots, has), want)
