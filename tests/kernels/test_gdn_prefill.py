"""gdn_prefill kernels vs the chunked and recurrent references (TRITON_INTERPRET on CPU): one sequence
and the varlen entry with in-place state slots, on tiny odd shapes with strided inputs."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import gdn_prefill as gp
from metainfer.kernels import reference as ref
from tests.helpers import rel_rmse

# (relative RMSE, max abs) vs the fp32 chunked reference on the same inputs. The interpreter computes
# dots in exact fp32 but rounds exactly as the GPU does (round-to-nearest bf16 casts), so the errors
# here are the GPU's: EXACT with state_prec="ieee"; the default state path (bf16x3, ~2^-16 per
# product) ~5e-6; bf16 inputs take the bf16 output path and a bf16 output (~4e-3).
EXACT = (1e-5, 1e-4)
TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (1e-2, 3e-2)}
STATE_TOL = (2e-5, 1e-4)
IEEE = gp.PrefillConfig(state_prec="ieee")


def _inputs(T, Hk, Hv, Dk, Dv, dtype, seed, strong_decay=False):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * Hk * Dk + Hv * Dv + 5  # strided views of one fused projection, as in the model
    qkv = torch.randn(T, width, generator=gen).to(dtype)
    q, k, v = torch.split(qkv[:, :-5], [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q, k, v = q.view(T, Hk, Dk), k.view(T, Hk, Dk), v.view(T, Hv, Dv)
    gb = torch.rand(T, 2 * Hv + 1, generator=gen)
    g = -gb[:, :Hv] * 2
    if strong_decay:
        g[::7] = -60.0
    beta = gb[:, Hv : 2 * Hv].to(dtype)
    return q, k, v, g, beta


def _recurrent_fp64(q, k, v, g, beta, state):
    rep = v.shape[1] // q.shape[1]
    q, k = (ref.l2norm(t.double(), 1e-6).repeat_interleave(rep, dim=1) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    S, outs = state.double().clone(), []
    for t in range(v.shape[0]):
        S = S * g[t].double().exp()[:, None, None]
        delta = (v[t].double() - torch.einsum("hkv,hk->hv", S, k[t])) * beta[t].double()[:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(outs), S


def _close(got, want, tol, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype)
    assert torch.isfinite(got.float()).all(), what
    err, mx = rel_rmse(got, want), (got.float() - want.float()).abs().max().item()
    assert err < tol[0] and mx < tol[1], (what, err, mx)


SLOW = pytest.mark.slow  # the interpreter runs one program for both dtypes: CI's slow pass runs the rest


# the default suite keeps every length in fp32 but 130 (65 crosses the same chunk boundary, with a tail),
# and bf16 at 1 and 65 (its output path); the other cases run in CI's slow pass
@pytest.mark.parametrize(
    "L,dtype",
    [pytest.param(L, dt, marks=() if L in keep else SLOW)
     for dt, keep in ((torch.float32, (1, 5, 63, 64, 65)), (torch.bfloat16, (1, 65)))
     for L in (1, 5, 63, 64, 65, 130)],
)
def test_gdn_prefill_single(L, dtype):
    Hk, Hv, Dk, Dv = 2, 4, 16, 16
    q, k, v, g, beta = _inputs(L, Hk, Hv, Dk, Dv, dtype, seed=L)
    init = torch.randn(Hv, Dk, Dv, generator=torch.Generator().manual_seed(L + 1)) * 0.5
    want, want_state = ref.gated_delta_rule_chunked(q, k, v, g, beta, init)
    init_copy = init.clone()
    got, got_state = gp.gdn_prefill(q, k, v, g, beta, init)
    assert torch.equal(init, init_copy)
    _close(got, want, TOL[dtype], "out")
    _close(got_state, want_state, STATE_TOL, "state")
    if dtype == torch.float32:
        exact, exact_state = gp.gdn_prefill(q, k, v, g, beta, init, cfg=IEEE)
        _close(exact, want, EXACT, "out, ieee")
        _close(exact_state, want_state, EXACT, "state, ieee")
        batch = (t[None] for t in (q, k, v, g, beta, init))
        rec, rec_state = ref.gated_delta_rule_recurrent(*batch)
        _close(exact, rec[0], EXACT, "out vs recurrent")
        _close(exact_state, rec_state[0], EXACT, "state vs recurrent")


@pytest.mark.parametrize("L,Dv", [(65, 8), (40, 24)])
def test_gdn_prefill_padded_dims_and_strong_decay(L, Dv):
    q, k, v, g, beta = _inputs(L, 1, 2, 16, Dv, torch.float32, seed=7 * L, strong_decay=True)
    init = torch.randn(2, 16, Dv, generator=torch.Generator().manual_seed(3))
    want, want_state = _recurrent_fp64(q, k, v, g, beta, init)
    got, got_state = gp.gdn_prefill(q, k, v, g, beta, init, cfg=gp.PrefillConfig(block_v=16))
    # e^c spans e^-600..1 here: the fp32 chunked reference is itself ~1e-5 off the fp64 recurrence
    _close(got.double(), want, (5e-5, 1e-4), "out")
    _close(got_state.double(), want_state, (5e-5, 1e-4), "state")


@pytest.mark.parametrize(
    "cfg,tol",
    [
        (gp.PrefillConfig(sub_block=8, state_prec="ieee"), EXACT),
        (gp.PrefillConfig(sub_block=32, block_v=16, state_prec="tf32x3"), EXACT),
        (gp.PrefillConfig(sub_block=64), TOL[torch.float32]),
        (gp.PrefillConfig(sub_block=1, prep_warps=8), TOL[torch.float32]),  # the inverse by 6 doublings only
        (gp.PrefillConfig(sub_block=16, prep_warps=8), TOL[torch.float32]),  # the defaults before KB-0047
        (gp.PrefillConfig(sub_block=16, state_prec="tf32", out_prec="bf16"), TOL[torch.bfloat16]),
    ],
)
def test_gdn_prefill_configs(cfg, tol):
    q, k, v, g, beta = _inputs(100, 2, 4, 16, 32, torch.float32, seed=5)
    init = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(6))
    want, want_state = ref.gated_delta_rule_chunked(q, k, v, g, beta, init)
    got, got_state = gp.gdn_prefill(q, k, v, g, beta, init, cfg=cfg)
    _close(got, want, tol, "out")
    _close(got_state, want_state, STATE_TOL, "state")


def test_gdn_prefill_empty():
    q, k, v, g, beta = _inputs(0, 2, 4, 16, 8, torch.float32, seed=0)
    init = torch.randn(4, 16, 8)
    out, final = gp.gdn_prefill(q, k, v, g, beta, init)
    assert out.shape == (0, 4, 8) and torch.equal(final, init)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=SLOW)])
def test_gdn_prefill_varlen(dtype):
    Hk, Hv, Dk, Dv, S = 2, 4, 16, 16, 7
    lens, has_list, slot_list = [70, 1, 0, 33], [True, False, False, True], [4, 0, 5, 2]
    lead, tail = 3, 2  # rows outside cu[0]:cu[N] (e.g. the step's decode tokens) stay untouched
    T = lead + sum(lens) + tail
    q, k, v, g, beta = _inputs(T, Hk, Hv, Dk, Dv, dtype, seed=11)
    gen = torch.Generator().manual_seed(12)
    state = torch.randn(S, Hv, Dk, Dv, generator=gen) * 0.5
    before = state.clone()
    cu_list = [lead]
    for n in lens:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32)
    slots, has = torch.tensor(slot_list), torch.tensor(has_list)
    out = torch.full((T, Hv, Dv), 7.0, dtype=dtype)
    ret = gp.gdn_prefill_varlen(q, k, v, g, beta, cu, state, slots, has, max(lens), out=out)
    assert ret is out
    assert torch.equal(out[:lead], torch.full_like(out[:lead], 7.0))
    assert torch.equal(out[cu_list[-1] :], torch.full_like(out[cu_list[-1] :], 7.0))
    for i, (s, e) in enumerate(zip(cu_list[:-1], cu_list[1:])):
        init = before[slot_list[i]] if has_list[i] else torch.zeros_like(before[0])
        if e == s:  # an empty sequence leaves its start state (zeros when it has none)
            assert torch.equal(state[slot_list[i]], init)
            continue
        want, want_state = ref.gated_delta_rule_chunked(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init)
        _close(out[s:e], want, TOL[dtype], f"out {i}")
        _close(state[slot_list[i]], want_state, STATE_TOL, f"state {i}")
    others = [i for i in range(S) if i not in slot_list]
    assert torch.equal(state[others], before[others])
    fresh = gp.gdn_prefill_varlen(q, k, v, g, beta, cu[:2], before.clone(), slots[:1], has[:1], lens[0])
    assert fresh.shape == (T, Hv, Dv)
    assert torch.equal(fresh[lead : cu_list[1]], out[lead : cu_list[1]])


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=SLOW), torch.bfloat16])
def test_gdn_prefill_varlen_gated(dtype):
    """gating=(A_log, dt_bias) with the raw projections a, b (strided, as split from in_proj): the
    prep kernel's gates give the result of `reference.gdn_gating` then the plain kernel (fp32:
    1e-5; bf16: 1e-2, the interpreter truncates beta's fp32 -> bf16 cast where torch rounds, one
    ulp = 0.4%), states alike; a's large values take the softplus(x) = x branch, pads of a partial
    chunk add nothing."""
    Hk, Hv, Dk, Dv, S = 2, 4, 16, 16, 6
    lens, has_list, slot_list = [70, 5, 33], [True, False, True], [4, 0, 2]
    T = sum(lens)
    q, k, v, _, _ = _inputs(T, Hk, Hv, Dk, Dv, dtype, seed=21)
    gen = torch.Generator().manual_seed(22)
    proj = (torch.randn(T, 2 * Hv + 3, generator=gen) * 4).to(dtype)
    proj[3, 1] = 25.0  # softplus threshold branch
    a, b = proj[:, :Hv], proj[:, Hv : 2 * Hv]
    A_log, dt_bias = torch.rand(Hv, generator=gen) * 2 - 1, torch.rand(Hv, generator=gen) - 3
    state = torch.randn(S, Hv, Dk, Dv, generator=gen) * 0.5
    cu = torch.tensor([0, 70, 75, 108], dtype=torch.int32)
    slots, has = torch.tensor(slot_list), torch.tensor(has_list)
    s1, s2 = state.clone(), state.clone()
    got = gp.gdn_prefill_varlen(q, k, v, a, b, cu, s1, slots, has, max(lens), gating=(A_log, dt_bias))
    g, beta = ref.gdn_gating(a, b, A_log, dt_bias)
    want = gp.gdn_prefill_varlen(q, k, v, g, beta, cu, s2, slots, has, max(lens))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_rmse(got, want) < tol and rel_rmse(s1, s2) < tol, (rel_rmse(got, want), rel_rmse(s1, s2))


@pytest.mark.parametrize(  # each dtype and each gating once in the default suite
    "dtype,gated",
    [(torch.float32, False), (torch.bfloat16, True),
     pytest.param(torch.float32, True, marks=SLOW), pytest.param(torch.bfloat16, False, marks=SLOW)],
)
def test_gdn_short_chunks_take_the_recurrent_kernel(dtype, gated, monkeypatch):
    """Chunks of at most RECURRENT_MAX_T tokens (speculative verifies) run the decode update token by
    token (`gdn_decode.gdn_recurrent_varlen`): against the fp64 recurrence (fp32: 1e-5 out and
    state; bf16: 1e-2, the bf16 output) and against the chunked kernels on the same call (bound 0), on
    odd head dims (Dk 12, Dv 24: masked lanes), GQA 2:4, an empty and a fresh sequence, rows outside
    cu[0]:cu[N] untouched."""
    from metainfer.kernels import gdn_decode

    Hk, Hv, Dk, Dv, S = 2, 4, 12, 24, 7
    lens, has_list, slot_list = [5, 1, 0, 16, 3], [True, False, False, True, True], [4, 0, 5, 2, 6]
    lead, tail = 2, 3
    T = lead + sum(lens) + tail
    q, k, v, g, beta = _inputs(T, Hk, Hv, Dk, Dv, dtype, seed=31)
    gen = torch.Generator().manual_seed(32)
    A_log, dt_bias = torch.rand(Hv, generator=gen) * 2 - 1, torch.rand(Hv, generator=gen) - 3
    if gated:  # raw projections a, b; the reference gates them as the kernels do
        proj = (torch.randn(T, 2 * Hv + 1, generator=gen) * 4).to(dtype)
        proj[lead + 1, 2] = 25.0  # the softplus(x) = x branch
        g, beta = proj[:, :Hv], proj[:, Hv : 2 * Hv]
        g_ref, beta_ref = ref.gdn_gating(g, beta, A_log, dt_bias)
    else:
        g_ref, beta_ref = g, beta
    state = torch.randn(S, Hv, Dk, Dv, generator=gen) * 0.5
    cu_list = [lead]
    for n in lens:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32)
    slots, has = torch.tensor(slot_list), torch.tensor(has_list)
    gating = (A_log, dt_bias) if gated else None
    runs = {}
    for max_t in (gdn_decode.RECURRENT_MAX_T, 0):  # the recurrent kernel, then the chunked kernels
        monkeypatch.setattr(gdn_decode, "RECURRENT_MAX_T", max_t)
        st, out = state.clone(), torch.full((T, Hv, Dv), 7.0, dtype=dtype)
        gp.gdn_prefill_varlen(q, k, v, g, beta, cu, st, slots, has, max(lens), out=out, gating=gating)
        runs[max_t] = st, out
    st, out = runs[16]
    assert torch.equal(out[:lead], torch.full_like(out[:lead], 7.0))
    assert torch.equal(out[cu_list[-1] :], torch.full_like(out[cu_list[-1] :], 7.0))
    tol = (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, 3e-2)
    for i, (s, e) in enumerate(zip(cu_list[:-1], cu_list[1:])):
        init = state[slot_list[i]] if has_list[i] else torch.zeros_like(state[0])
        if e == s:
            assert torch.equal(st[slot_list[i]], init)
            continue
        want, want_state = _recurrent_fp64(q[s:e], k[s:e], v[s:e], g_ref[s:e].float(), beta_ref[s:e], init)
        _close(out[s:e], want.to(dtype), tol, f"out {i}")
        _close(st[slot_list[i]], want_state.float(), (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, 3e-2),
               f"state {i}")
    others = [i for i in range(S) if i not in slot_list]
    assert torch.equal(st[others], state[others])
    c_st, c_out = runs[0]  # the chunked kernels agree (bf16: their bf16 output path)
    assert rel_rmse(out[lead : cu_list[-1]], c_out[lead : cu_list[-1]]) < tol[0] and rel_rmse(st, c_st) < 1e-2


def test_gdn_prefill_varlen_bf16_state_storage():
    """--ssm-state-dtype bfloat16: the scan reads the bf16 initial state, runs in fp32 and stores
    the final state rounded to bf16 (rel. RMSE < 1e-2 against the fp32 reference from the same
    rounded start); the CPU reference path (`ops.gdn_prefill_varlen`) takes bf16 storage too."""
    from metainfer.kernels import ops

    Hk, Hv, Dk, Dv, S = 2, 4, 16, 16, 5
    lens, slot_list = [70, 9], [3, 1]
    T = sum(lens)
    q, k, v, g, beta = _inputs(T, Hk, Hv, Dk, Dv, torch.float32, seed=21)
    state = (torch.randn(S, Hv, Dk, Dv, generator=torch.Generator().manual_seed(22)) * 0.5).bfloat16()
    cu = torch.tensor([0, lens[0], T], dtype=torch.int32)
    slots, has = torch.tensor(slot_list), torch.tensor([True, True])
    got_state, ref_state = state.clone(), state.clone()
    out = gp.gdn_prefill_varlen(q, k, v, g, beta, cu, got_state, slots, has, max(lens))
    ref_out = ops.gdn_prefill_varlen(q, k, v, g, beta, cu, ref_state, slots, has, max(lens),
                                     torch.empty(T, Hv, Dv))
    assert got_state.dtype == ref_state.dtype == torch.bfloat16
    for i, (s, e) in enumerate([(0, lens[0]), (lens[0], T)]):
        want, want_state = ref.gated_delta_rule_chunked(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                                        state[slot_list[i]].float())
        _close(out[s:e], want, TOL[torch.float32], f"out {i}")
        _close(ref_out[s:e], want, EXACT, f"reference out {i}")
        assert rel_rmse(got_state[slot_list[i]].float(), want_state) < 1e-2
        assert torch.equal(ref_state[slot_list[i]], want_state.bfloat16())
