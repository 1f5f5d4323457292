"""The FP8 wgmma projection of one token (metainfer/kernels/cuda/gemv.cu) on the H200 (skipped without an
sm_90 GPU and nvcc): against a float64 reference of the dequantised weights, against the Triton path it
replaces (`fp8_linear` with gemv.cu declining: `_triton_only`), inside a CUDA graph, and in a PDL chain after
a Triton kernel that writes its input (the wait before reading x).

Tolerance (relative RMSE): 5e-3 against float64 (bf16 outputs: 2^-9 rounding; x's two e4m3 terms are exact for
bf16 down to 2^-9 of each 128-column block's largest), 8e-3 against the Triton path (both rounded to bf16)."""

from __future__ import annotations

import shutil

import pytest
import torch

from metainfer.kernels import fp8_linear, norm, pdl
from metainfer.kernels.cuda import gemv
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


def _captured_with_new_input(step, src):
    """step() captured in a CUDA graph, src refilled with new values, the graph replayed: -> its outputs."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    src.copy_(torch.randn_like(src))
    graph.replay()
    torch.cuda.synchronize()
    return out


def _triton_only(monkeypatch):
    """gemv.cu declines every shape from here on (no kernel loaded): the Triton paths it replaces serve."""
    monkeypatch.setattr(gemv, "_kernel", lambda device: None)


def _reference(x, w, s):
    deq = w.double() * s.double().repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)
    return (x.double() @ deq.T).float()


@pytest.mark.parametrize("n", [16, 144, 9216, 12352])
def test_matches_float64_and_the_triton_path(n, monkeypatch):
    x, w, s = _problem(n)
    assert gemv.wanted(x, w, s)
    got = fp8_linear.fp8_linear(x, w, s)
    _triton_only(monkeypatch)
    triton_y = fp8_linear.fp8_linear(x, w, s)
    want = _reference(x, w, s)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    assert rel_rmse(got.float(), want) < 5e-3
    assert rel_rmse(got.float(), triton_y.float()) < 8e-3


def test_not_wanted_off_its_shapes(monkeypatch):
    x, w, s = _problem(144)
    assert not gemv.wanted(x.float(), w, s)  # bf16 x only
    assert not gemv.wanted(torch.cat([x, x]), w, s)  # one token
    w2, s2 = quantize_fp8_block(torch.randn(136, gemv.K, device="cuda"))
    assert not gemv.wanted(x, w2, s2)  # N a multiple of 16
    _triton_only(monkeypatch)
    assert not gemv.wanted(x, w, s)


def test_graph_replay_and_pdl_chain(monkeypatch):
    """An RMSNorm (Triton, PDL) writes x, the projection reads it: eager, then captured in a graph and
    replayed with a new input; the same bits both ways."""
    _, w, s = _problem(9216, seed=1)
    src = torch.randn(1, gemv.K, device="cuda").to(torch.bfloat16)
    nw = torch.randn(gemv.K, device="cuda").to(torch.bfloat16)

    def step():
        return fp8_linear.fp8_linear(norm.rms_norm(src, nw, 1e-6), w, s)

    assert pdl.enabled()
    eager = step()
    assert rel_rmse(eager.float(), _reference(norm.rms_norm(src, nw, 1e-6), w, s)) < 5e-3
    out = _captured_with_new_input(step, src)
    assert torch.equal(out, step())


@pytest.mark.parametrize("has", [True, False])
def test_conv_epilogue_matches_the_triton_path(has, monkeypatch):
    """The DeltaNet in_proj with its decode conv (`linear_conv_update`): output and conv state against the
    Triton kernel's epilogue (both bf16; the projections' sums differ in order, so a bf16 step here and
    there)."""
    C, S = 8192, 5
    x, w, s = _problem(12352, seed=2)
    cw = (torch.randn(C, 4, device="cuda") * 0.5).to(torch.bfloat16)
    state = torch.randn(S, 3, C, device="cuda").to(torch.bfloat16)
    slots = torch.tensor([3], device="cuda")
    has_state = torch.tensor([has], device="cuda")
    ref_state = state.clone()
    assert gemv.wanted_conv(x, w, s, cw, state, slots)
    got = fp8_linear.linear_conv_update(x, w, s, cw, state, slots, has_state)
    with monkeypatch.context() as mp:
        _triton_only(mp)
        want = fp8_linear.linear_conv_update(x, w, s, cw, ref_state, slots, has_state)
    assert rel_rmse(got[:, :C].float(), want[:, :C].float()) < 8e-3  # the conv's columns
    assert rel_rmse(got[:, C:].float(), want[:, C:].float()) < 8e-3  # z, b, a: the projection alone
    assert rel_rmse(state.float(), ref_state.float()) < 8e-3
    assert torch.equal(state[:3], ref_state[:3]) and torch.equal(state[4:], ref_state[4:])  # other slots
    assert torch.equal(state[3, :2], ref_state[3, :2])  # the shifted rows: copies (zeros without a state)


def _moe_problem(E: int, top_k: int, seed: int, ties: bool, rows: int = 1024):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w, s = quantize_fp8_block(torch.randn(E + 1, rows, gemv.K, generator=g, device="cuda") * 0.05)
    x = (torch.randn(1, gemv.K, generator=g, device="cuda") * 2).to(torch.bfloat16)
    if ties:  # few distinct values: exact ties at the picks, and -0.0 beside +0.0
        logits = torch.randint(-2, 2, (1, E + 1), generator=g, device="cuda").float() * 0.5
        logits[0, 3] = -0.0
    else:
        logits = torch.randn(1, E + 1, generator=g, device="cuda") * 2
    return x, logits.to(torch.bfloat16), w, s


@pytest.mark.parametrize("E,top_k,ties", [(256, 8, False), (256, 8, True), (40, 5, True), (7, 3, False)])
def test_moe_gate_up_routes_and_projects(E, top_k, ties, monkeypatch):
    """cuda/gemv.cu's experts' gate/up for one token: its picks equal the Triton
    routing's (`routing.route_topk`, ties to the lowest index) exactly, its weights within 1e-5, and each
    pair's rows (routed in slot order, then the shared expert) against float64 within 5e-3."""
    from metainfer.kernels import routing

    x, logits, w, s = _moe_problem(E, top_k, seed=E + top_k, ties=ties)
    assert gemv.wanted_moe(x, logits, top_k, w, s)
    gu, tw, ids = gemv.moe_gate_up(x, logits, top_k, w, s)
    want_tw, want_ids = routing.route_topk(logits, top_k, shared=True)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(tw, want_tw, rtol=1e-5, atol=1e-7)
    for j, e in enumerate(ids[0].tolist()):
        assert rel_rmse(gu[j], _reference(x, w[e], s[e])[0]) < 5e-3


@pytest.mark.parametrize("ties", [False, True])
def test_moe_routed_rows_on_gemv_equal_the_triton_path(ties, monkeypatch):
    """`moe_routed_rows` at one token with the gate/up on gemv.cu (the down kernel forms silu(gate) * up from
    its fp32 dots, routing itself from the same logits) against the Triton gate/up: rows within 8e-3 (bf16
    activations either side), weights within 1e-5; in a CUDA graph after a Triton norm + router (PDL chain),
    replay equal to eager bit for bit."""
    from metainfer.kernels import moe

    E, top_k = 256, 8
    x, logits, w, s = _moe_problem(E, top_k, seed=11, ties=ties)
    g = torch.Generator(device="cuda").manual_seed(12)
    w_dn, s_dn = quantize_fp8_block(torch.randn(E + 1, gemv.K, 512, generator=g, device="cuda") * 0.05)
    rows, tw = moe.moe_routed_rows(x, logits, top_k, True, w, w_dn, s, s_dn)
    with monkeypatch.context() as mp:
        _triton_only(mp)
        want_rows, want_tw = moe.moe_routed_rows(x, logits, top_k, True, w, w_dn, s, s_dn)
    assert rows.shape == want_rows.shape == (1, top_k + 1, gemv.K)
    assert rel_rmse(rows, want_rows) < 8e-3
    assert torch.allclose(tw, want_tw, rtol=1e-5, atol=1e-7)

    src, res = x.clone(), torch.randn_like(x)
    nw = (1 + 0.1 * torch.randn(gemv.K, device="cuda")).to(torch.bfloat16)
    router = (torch.randn(E + 1, gemv.K, device="cuda") * 0.05).to(torch.bfloat16)

    def step():
        h, _, lg = norm.add_rms_norm_router(src, res, nw, 1e-6, router)
        return moe.moe_routed_rows(h, lg, top_k, True, w, w_dn, s, s_dn)

    assert pdl.enabled()
    eager = step()
    out = _captured_with_new_input(step, src)
    again = step()
    assert torch.equal(out[0], again[0]) and torch.equal(out[1], again[1])
    assert not torch.equal(out[0], eager[0])  # a new input, new rows


def _pre_problem(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.randn(1, 9, gemv.K, generator=g, device="cuda") * 0.5
    tw = torch.rand(1, 9, generator=g, device="cuda")
    residual = torch.randn(1, gemv.K, generator=g, device="cuda").to(torch.bfloat16)
    nw = (0.1 * torch.randn(gemv.K, generator=g, device="cuda")).to(torch.bfloat16)
    return rows, tw, residual, nw


@pytest.mark.parametrize("conv", [False, True])
def test_pre_prologue_equals_the_norm_then_the_projection(conv, monkeypatch):
    """gemv_e4m3_pre: the previous MoE's rows summed into the residual and the
    input RMSNorm in the x prologue, against norm.moe_add_rms_norm then the projection (gemv.cu's plain form;
    with conv, the in_proj and its decode conv): outputs within 8e-3 (the norm's sum of squares reduces in
    another order: a bf16 step in x here and there), the new residual the same bits but for rare elements."""
    from metainfer.kernels import norm

    rows, tw, residual, nw = _pre_problem(21 + conv)
    want_h, want_res = norm.moe_add_rms_norm(rows, tw, residual, nw, 1e-6)
    new_res = torch.empty_like(residual)
    if not conv:
        _, w, s = _problem(9216, seed=22)
        got = gemv.project_pre(rows, tw, residual, nw, 1e-6, new_res, w, s)
        want = fp8_linear.fp8_linear(want_h, w, s)
        assert got is not None and rel_rmse(got.float(), want.float()) < 8e-3
    else:
        _, w, s = _problem(12352, seed=23)
        C = 8192
        cw = (torch.randn(C, 4, device="cuda") * 0.5).to(torch.bfloat16)
        state = torch.randn(5, 3, C, device="cuda").to(torch.bfloat16)
        ref_state = state.clone()
        slots, has = torch.tensor([2], device="cuda"), torch.tensor([True], device="cuda")
        got = gemv.project_pre(rows, tw, residual, nw, 1e-6, new_res, w, s, conv=(cw, state, slots, has))
        want = fp8_linear.linear_conv_update(want_h, w, s, cw, ref_state, slots, has)
        assert got is not None and rel_rmse(got.float(), want.float()) < 8e-3
        assert rel_rmse(state.float(), ref_state.float()) < 8e-3
    assert rel_rmse(new_res.float(), want_res.float()) < 1e-3
    assert (new_res != want_res).float().mean() < 0.01
    _triton_only(monkeypatch)
    assert gemv.project_pre(rows, tw, residual, nw, 1e-6, new_res, w, s) is None  # declined: the norm first


def test_pre_prologue_graph_replay():
    """The prologue's kernel captured in a CUDA graph and replayed with new rows: the same bits as eager."""
    rows, tw, residual, nw = _pre_problem(31)
    _, w, s = _problem(9216, seed=32)
    new_res = torch.empty_like(residual)

    def step():
        return gemv.project_pre(rows * 1.0, tw, residual, nw, 1e-6, new_res, w, s)

    eager = step()
    out = _captured_with_new_input(step, rows)
    res_graph = new_res.clone()
    again = step()
    assert torch.equal(out, again) and torch.equal(res_graph, new_res)
    assert not torch.equal(out, eager)


@pytest.fixture
def timeline_build():
    """gemv.cu's timeline build loaded for the test (the default build reloaded after it)."""
    from metainfer.kernels.cuda import gemv_timeline

    gemv.use_timeline_build(True)
    gemv.reset()
    yield gemv_timeline
    gemv.use_timeline_build(False)
    gemv.reset()


def test_timeline_build_records_each_cta_and_computes_the_same(timeline_build):
    """The timeline build (-DGEMV_TIMELINE=1): the same output bits as the default build, one record a CTA of
    each launch in its sequence slot, the events of each CTA in their order on one time axis, and nothing
    written once the records are off."""
    T = timeline_build
    x, w, s = _problem(12352, seed=41)
    rows, tw, residual, nw = _pre_problem(42)
    new_res = torch.empty_like(residual)
    rec = T.Recorder(x.device, slots=8)
    y = fp8_linear.fp8_linear(x, w, s)
    p = gemv.project_pre(rows, tw, residual, nw, 1e-6, new_res, w, s)
    lns = T.decode(rec.read())
    assert [ln.kind for ln in lns] == ["gemv_e4m3", "gemv_e4m3_pre"] and lns[1].seq == lns[0].seq + 1
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for ln in lns:
        assert ln.n_rows == 12352 and ln.grid == min(sms, 12352 // 16) and len(ln.events["in"]) == ln.grid
        order = ["in", "wait", "staged", "x", "first", "end0"]
        for cta in range(ln.grid):
            t = [ln.events[e][cta] for e in order]
            assert t == sorted(t), (ln.kind, cta, dict(zip(order, t)))
            assert ln.events["first1"][cta] <= ln.events["end1"][cta]
        assert 0 < max(ln.events["end"]) < 1000  # µs: the SMs' clocks lined up
    assert all(r == r for r in lns[1].events["rows"]) and all(r != r for r in lns[0].events["rows"])
    rec.close()
    rec.clear()
    y2 = fp8_linear.fp8_linear(x, w, s)
    assert T.decode(rec.read()) == []  # off: nothing written
    gemv.use_timeline_build(False)
    gemv.reset()
    assert gemv._kernel(x.device).timeline_built is False
    new_res2 = torch.empty_like(residual)
    assert torch.equal(fp8_linear.fp8_linear(x, w, s), y) and torch.equal(y2, y)
    assert torch.equal(gemv.project_pre(rows, tw, residual, nw, 1e-6, new_res2, w, s), p)
    assert torch.equal(new_res2, new_res)
