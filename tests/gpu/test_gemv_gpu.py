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


def _captured_with_new_input(step, src):
    """step() captured in a CUDA graph, src refilled with new values, the graph replayed: -> its outputs."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    src.copy_(torch.randn_like(src))
    graph.replay()
    torch.cuda.synchronize()
    return out


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
    out = _captured_with_new_input(step, src)
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
    """mega/gemv.cu's experts' gate/up for one token (METAINFER_WGMMA_GEMV_MOE=1): its picks equal the Triton
    routing's (`routing.route_topk`, ties to the lowest index) exactly, its weights within 1e-5, and each
    pair's rows (routed in slot order, then the shared expert) against float64 within 5e-3."""

    monkeypatch.setenv(gemv.MOE_ENV, "1")
    x, logits, w, s = _moe_problem(E, top_k, seed=E + top_k, ties=ties)
    gu, ids = _moe_routed_like_triton(x, logits, top_k, w, s)
    for j, e in enumerate(ids[0].tolist()):
        assert rel_rmse(gu[j], _reference(x, w[e], s[e])[0]) < 5e-3


def _moe_routed_like_triton(x, logits, top_k, w, s):
    """gemv.moe_gate_up (wanted) with the Triton routing's picks exactly and its weights within 1e-5:
    -> (gu, ids)."""
    from metainfer.kernels import routing

    assert gemv.wanted_moe(x, logits, top_k, w, s)
    gu, tw, ids = gemv.moe_gate_up(x, logits, top_k, w, s)
    want_tw, want_ids = routing.route_topk(logits, top_k, shared=True)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(tw, want_tw, rtol=1e-5, atol=1e-7)
    return gu, ids


@pytest.mark.parametrize("E,top_k,ties", [(256, 8, False), (256, 8, True), (40, 5, True)])
def test_moe_gate_up_bf16_routes_and_projects(E, top_k, ties, monkeypatch):
    """moe_gate_up_bf16 (METAINFER_WGMMA_GEMV_BF16=1, KB-0114): bf16 experts, 8 rows a chunk; the picks
    equal the Triton routing's exactly, the weights within 1e-5, each pair's fp32 rows against an fp32
    product within 1e-4 (bf16 products are exact, the sums' order differs); then `moe_routed_rows` (with the
    Triton down) on it against the BF16 path of today (`moe_rows`: the route launch and the pair kernels)
    within 8e-3."""
    from metainfer.kernels import moe, ops

    monkeypatch.setenv(gemv.BF16_ENV, "1")
    x, logits, _, _ = _moe_problem(E, top_k, seed=E + top_k + 7, ties=ties)
    g = torch.Generator(device="cuda").manual_seed(E + 3)
    w = (torch.randn(E + 1, 1024, gemv.K, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    w_dn = (torch.randn(E + 1, gemv.K, 512, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    gu, ids = _moe_routed_like_triton(x, logits, top_k, w, None)
    for j, e in enumerate(ids[0].tolist()):
        assert rel_rmse(gu[j], w[e].float() @ x[0].float()) < 1e-4
    assert moe.routed_rows_bf16_ok(x, logits, top_k, True, w)
    rows, tw2 = moe.moe_routed_rows(x, logits, top_k, True, w, w_dn)
    ops.use_kernels(True)  # (the registry, for moe_rows)
    want_rows, want_tw2 = ops.moe_rows(x, logits, top_k, w, w_dn)
    assert rel_rmse(rows, want_rows.view_as(rows).float()) < 8e-3
    assert torch.allclose(tw2, want_tw2, rtol=1e-5, atol=1e-7)
    monkeypatch.setenv(gemv.BF16_ENV, "0")
    assert not gemv.wanted_moe(x, logits, top_k, w, None)
    assert not moe.routed_rows_bf16_ok(x, logits, top_k, True, w)


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
    monkeypatch.setenv(gemv.MOE_ENV, "0")
    want_rows, want_tw = moe.moe_routed_rows(x, logits, top_k, True, w, w_dn, s, s_dn)
    monkeypatch.setenv(gemv.MOE_ENV, "1")
    rows, tw = moe.moe_routed_rows(x, logits, top_k, True, w, w_dn, s, s_dn)
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


def _check_pre_conv(pre: tuple, want_h: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None) -> None:
    """project_pre of the in_proj with its decode conv (pre: rows, tw, residual, norm weight, new_res) against
    `weight_stream.linear_conv_update` of the normed x (want_h): outputs and conv states within 8e-3."""
    from metainfer.kernels import weight_stream

    rows, tw, residual, nw, new_res = pre
    C = 8192
    cw = (torch.randn(C, 4, device="cuda") * 0.5).to(torch.bfloat16)
    state = torch.randn(5, 3, C, device="cuda").to(torch.bfloat16)
    ref_state = state.clone()
    slots, has = torch.tensor([2], device="cuda"), torch.tensor([True], device="cuda")
    got = gemv.project_pre(rows, tw, residual, nw, 1e-6, new_res, w, s, conv=(cw, state, slots, has))
    want = weight_stream.linear_conv_update(want_h, w, s, cw, ref_state, slots, has)
    assert got is not None and rel_rmse(got.float(), want.float()) < 8e-3
    assert rel_rmse(state.float(), ref_state.float()) < 8e-3


@pytest.mark.parametrize("conv", [False, True])
def test_pre_prologue_equals_the_norm_then_the_projection(conv, monkeypatch):
    """gemv_e4m3_pre (METAINFER_WGMMA_GEMV_PRE=1): the previous MoE's rows summed into the residual and the
    input RMSNorm in the x prologue, against norm.moe_add_rms_norm then the projection (gemv.cu's plain form;
    with conv, the in_proj and its decode conv): outputs within 8e-3 (the norm's sum of squares reduces in
    another order: a bf16 step in x here and there), the new residual the same bits but for rare elements."""
    from metainfer.kernels import norm

    monkeypatch.setenv(gemv.PRE_ENV, "1")
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
        _check_pre_conv((rows, tw, residual, nw, new_res), want_h, w, s)
    assert rel_rmse(new_res.float(), want_res.float()) < 1e-3
    assert (new_res != want_res).float().mean() < 0.01
    monkeypatch.setenv(gemv.PRE_ENV, "0")
    assert gemv.project_pre(rows, tw, residual, nw, 1e-6, new_res, w, s) is None  # off: the caller's norm


@pytest.mark.parametrize("n,conv", [(9216, False), (12352, True), (1032, False)])
def test_bf16_pre_prologue_equals_the_norm_then_the_projection(n, conv, monkeypatch):
    """gemv_bf16_pre (METAINFER_WGMMA_GEMV_BF16=1, KB-0114): bf16 weights, 8 rows a chunk, the same prologue
    and conv epilogue, against norm.moe_add_rms_norm then an fp32 product rounded to bf16 (and the conv of
    `weight_stream.linear_conv_update`): within 8e-3 (bf16 products are exact in wgmma's fp32 accumulation;
    the norm's sum reduces in another order); N = 1,032: an odd chunk count (129, one round). Off: None."""
    from metainfer.kernels import norm

    monkeypatch.setenv(gemv.BF16_ENV, "1")
    rows, tw, residual, nw = _pre_problem(41 + n % 7)
    g = torch.Generator(device="cuda").manual_seed(42)
    w = (torch.randn(n, gemv.K, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    want_h, want_res = norm.moe_add_rms_norm(rows, tw, residual, nw, 1e-6)
    new_res = torch.empty_like(residual)
    if not conv:
        got = gemv.project_pre(rows, tw, residual, nw, 1e-6, new_res, w, None)
        want = (want_h.float() @ w.float().T).to(torch.bfloat16)
        assert got is not None
        err = rel_rmse(got.float(), want.float())
        assert err < 8e-3, err
    else:
        _check_pre_conv((rows, tw, residual, nw, new_res), want_h, w, None)
    assert rel_rmse(new_res.float(), want_res.float()) < 1e-3
    monkeypatch.setenv(gemv.BF16_ENV, "0")
    assert gemv.project_pre(rows, tw, residual, nw, 1e-6, new_res, w, None) is None  # off: the caller's norm


def test_bf16_pre_graph_replay(monkeypatch):
    """gemv_bf16_pre captured in a CUDA graph and replayed with new rows: the same bits as eager."""
    monkeypatch.setenv(gemv.BF16_ENV, "1")
    rows, tw, residual, nw = _pre_problem(51)
    w = (torch.randn(9216, gemv.K, device="cuda") * 0.05).to(torch.bfloat16)
    new_res = torch.empty_like(residual)

    def step():
        return gemv.project_pre(rows * 1.0, tw, residual, nw, 1e-6, new_res, w, None)

    eager = step()
    out = _captured_with_new_input(step, rows)
    again = step()
    assert torch.equal(out, again) and not torch.equal(out, eager)


def test_pre_prologue_graph_replay(monkeypatch):
    """The prologue's kernel captured in a CUDA graph and replayed with new rows: the same bits as eager."""
    monkeypatch.setenv(gemv.PRE_ENV, "1")
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


# ---- the DeltaNet decode step in the in_proj's launch (gemv_e4m3_pre_gdn, METAINFER_WGMMA_GEMV_GDN) ----
HK, HV, D = 16, 32, 128  # the model's DeltaNet heads
C_CONV, N_IN = (2 * HK + HV) * D, (2 * HK + 2 * HV) * D + 2 * HV  # conv channels (q, k, v), in_proj rows
B_OFF, A_OFF = (2 * HK + 2 * HV) * D, (2 * HK + 2 * HV) * D + HV


def _gdn_problem(seed: int, has: bool, gate_dtype: torch.dtype):
    rows, tw, residual, nw = _pre_problem(seed)
    _, w, s = _problem(N_IN, seed=seed + 1)
    g = torch.Generator(device="cuda").manual_seed(seed + 2)
    cw = (torch.randn(C_CONV, 4, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    conv_state = torch.randn(5, 3, C_CONV, generator=g, device="cuda").to(torch.bfloat16)
    ssm = torch.randn(5, HV, D, D, generator=g, device="cuda") * 0.1
    A_log = torch.log(torch.rand(HV, generator=g, device="cuda") * 15 + 1).to(gate_dtype)
    dt_bias = (torch.randn(HV, generator=g, device="cuda") * 0.5).to(gate_dtype)
    slots, has_t = torch.tensor([3], device="cuda"), torch.tensor([has], device="cuda")
    count = torch.zeros(HV, dtype=torch.int32, device="cuda")
    return dict(rows=rows, tw=tw, residual=residual, nw=nw, w=w, s=s, cw=cw, conv_state=conv_state, ssm=ssm,
                A_log=A_log, dt_bias=dt_bias, slots=slots, has=has_t, count=count)


def _fused(p, new_res):
    return gemv.project_pre_gdn(p["rows"], p["tw"], p["residual"], p["nw"], 1e-6, new_res, p["w"], p["s"],
                                conv=(p["cw"], p["conv_state"], p["slots"], p["has"]),
                                gdn=(p["A_log"], p["dt_bias"], p["ssm"], p["count"], HK, HV, B_OFF, A_OFF))


def _unfused(p, new_res):
    """The two launches it replaces: gemv_e4m3_pre (the in_proj and its conv), then the Triton decode step."""
    from metainfer.kernels import gdn_decode

    y = gemv.project_pre(p["rows"], p["tw"], p["residual"], p["nw"], 1e-6, new_res, p["w"], p["s"],
                         conv=(p["cw"], p["conv_state"], p["slots"], p["has"]))
    q, k, v = y[:, :HK * D], y[:, HK * D:2 * HK * D], y[:, 2 * HK * D:C_CONV]
    core = gdn_decode.gdn_decode_gated(q.view(1, HK, D), k.view(1, HK, D), v.view(1, HV, D), y[:, A_OFF:],
                                       y[:, B_OFF:A_OFF], p["A_log"], p["dt_bias"], p["ssm"], p["slots"],
                                       p["has"])
    return y, core


def _clone(p):
    return {k: v.clone() for k, v in p.items()}


@pytest.mark.parametrize("has,gate_dtype",
                         [(True, torch.float32), (False, torch.float32), (True, torch.bfloat16)])
def test_gdn_step_in_the_in_proj_launch(has, gate_dtype, monkeypatch):
    """gemv_e4m3_pre_gdn against gemv_e4m3_pre then `gdn_decode_gated`, over three steps (the state and the
    rows change; the arrival counters must be back at zero after each launch): the projection, the new
    residual and the conv state the same bits (the same dots and epilogue, in another chunk order); the step's
    output within 4e-3 relative RMSE (bf16, its sums in another order) and the fp32 state within 1e-4."""
    monkeypatch.setenv(gemv.GDN_ENV, "1")
    p = _gdn_problem(41 + has, has, gate_dtype)
    ref = _clone(p)
    for step in range(3):
        new_res, ref_res = torch.empty_like(p["residual"]), torch.empty_like(p["residual"])
        got = _fused(p, new_res)
        assert got is not None, "not wanted"
        y, core = got
        want_y, want_core = _unfused(ref, ref_res)
        torch.cuda.synchronize()
        assert torch.equal(y, want_y) and torch.equal(new_res, ref_res), step
        assert torch.equal(p["conv_state"], ref["conv_state"]), step
        err = rel_rmse(core.float(), want_core.float())
        assert err < 4e-3, (step, err)
        assert rel_rmse(p["ssm"], ref["ssm"]) < 1e-4, (step, rel_rmse(p["ssm"], ref["ssm"]))
        assert torch.equal(p["ssm"][:3], ref["ssm"][:3]) and torch.equal(p["ssm"][4:], ref["ssm"][4:])
        assert not p["count"].any(), p["count"]
        g = torch.Generator(device="cuda").manual_seed(100 + step)  # the next step's rows
        p["rows"].copy_(torch.randn(p["rows"].shape, generator=g, device="cuda") * 0.5)
        ref["rows"].copy_(p["rows"])
        p["has"].fill_(True)
        ref["has"].fill_(True)


def test_gdn_step_graph_replay_and_switch(monkeypatch):
    """The fused launch captured in a CUDA graph, replayed with new rows: the eager launch's bits on the same
    inputs (states restored in between); off by default and with the switch at 0 (-> None)."""
    monkeypatch.delenv(gemv.GDN_ENV, raising=False)
    p = _gdn_problem(51, True, torch.float32)
    assert _fused(p, torch.empty_like(p["residual"])) is None  # off by default (unmeasured)
    monkeypatch.setenv(gemv.GDN_ENV, "1")
    new_res = torch.empty_like(p["residual"])
    start = _clone(p)
    assert _fused(p, new_res) is not None  # eager first: the kernel is built outside the capture
    for k in ("ssm", "conv_state"):
        p[k].copy_(start[k])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, core = _fused(p, new_res)
    for k in ("ssm", "conv_state", "count"):
        p[k].copy_(start[k])  # (capture launches nothing; restored all the same)
    p["rows"].copy_(torch.randn_like(p["rows"]))
    graph.replay()
    torch.cuda.synchronize()
    got = (y.clone(), core.clone(), p["ssm"].clone(), p["conv_state"].clone())
    for k in ("ssm", "conv_state"):
        p[k].copy_(start[k])
    y2, core2 = _fused(p, torch.empty_like(new_res))
    torch.cuda.synchronize()
    assert torch.equal(got[0], y2) and torch.equal(got[1], core2)
    assert torch.equal(got[2], p["ssm"]) and torch.equal(got[3], p["conv_state"])
    assert not p["count"].any()
    monkeypatch.setenv(gemv.GDN_ENV, "0")
    assert _fused(p, new_res) is None


# ---- the experts' down in the gate/up's launch (moe_gate_up_down_e4m3, METAINFER_WGMMA_GEMV_MOE_DOWN) ----
def _down_weights(E: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return quantize_fp8_block(torch.randn(E + 1, gemv.K, gemv.SEG, generator=g, device="cuda") * 0.05)


def _two_launches(x, logits, top_k, w, s, wd, sd):
    """moe_gate_up, then `moe._routed_down` on its dots (the Triton down it replaces)."""
    from metainfer.kernels import moe

    gu, tw, ids = gemv.moe_gate_up(x, logits, top_k, w, s)
    y = moe._routed_down(gu, wd, moe._scale_args(sd, wd), logits, top_k, top_k + 1, True,
                         moe.pair_config(1, True), gu=True)
    return y, tw, ids


@pytest.mark.parametrize("E,top_k,ties", [(256, 8, False), (256, 8, True), (40, 5, True)])
def test_moe_gate_up_down_equals_the_two_launches(E, top_k, ties, monkeypatch):
    """moe_gate_up_down_e4m3 against moe_gate_up then the Triton down, three launches in a row (the counts
    must be back at zero after each): the routing weights and ids the same bits, each pair's rows within 8e-3
    relative RMSE (x = silu(gate) * up as two e4m3 terms: exact down to 2^-9 of each 128 block's largest; the
    Triton down multiplies the bf16 values)."""
    monkeypatch.setenv(gemv.MOE_DOWN_ENV, "1")
    x, logits, w, s = _moe_problem(E, top_k, 61 + ties, ties)
    wd, sd = _down_weights(E, 62)
    assert gemv.wanted_moe_down(x, logits, top_k, w, s, wd, sd)
    kernel = gemv._kernel(x.device)
    for step in range(3):
        got, tw, ids = gemv.moe_gate_up(x, logits, top_k, w, s, down=(wd, sd))
        want, want_tw, want_ids = _two_launches(x, logits, top_k, w, s, wd, sd)
        torch.cuda.synchronize()
        assert torch.equal(tw, want_tw) and torch.equal(ids, want_ids), step
        err = rel_rmse(got, want.view_as(got))
        assert err < 8e-3, (step, err)
        assert not kernel.moe_count.any(), kernel.moe_count
        x = (torch.randn_like(x.float()) * 2).to(torch.bfloat16)
    monkeypatch.setenv(gemv.MOE_DOWN_ENV, "0")
    assert not gemv.wanted_moe_down(x, logits, top_k, w, s, wd, sd)  # off: the two launches
    monkeypatch.delenv(gemv.MOE_DOWN_ENV)
    assert not gemv.wanted_moe_down(x, logits, top_k, w, s, wd, sd)  # off by default (unmeasured)


@pytest.mark.parametrize("down", [False, True])
def test_moe_next_l2_is_only_a_hint(down, monkeypatch):
    """The experts' launch prefetching the next projection's first chunks into L2
    (METAINFER_WGMMA_GEMV_NEXT_L2, rotated as gemv_e4m3_pre_gdn takes them): the same bits as without, with
    and without the fused down."""
    x, logits, w, s = _moe_problem(256, 8, 81, False)
    wd, sd = _down_weights(256, 82)
    w_next = (torch.randn(12352, 2048, device="cuda") * 0.1).to(torch.float8_e4m3fn)
    monkeypatch.setenv(gemv.MOE_DOWN_ENV, "1" if down else "0")
    kw = dict(down=(wd, sd)) if down else {}
    monkeypatch.setenv(gemv.NEXT_L2_ENV, "0")
    assert gemv.next_l2((w_next, 768), x.device) is None  # off: nothing to prefetch
    want = gemv.moe_gate_up(x, logits, 8, w, s, **kw)
    monkeypatch.setenv(gemv.NEXT_L2_ENV, "6")
    nx = gemv.next_l2((w_next, 768), x.device)
    assert nx is not None and (nx.n, nx.rot, nx.k) == (772, 768, 6)
    for rot in (0, 768):
        got = gemv.moe_gate_up(x, logits, 8, w, s, prefetch=(w_next, rot), **kw)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want)), rot


def _router_problem(E: int, seed: int):
    """The post-mixer add's operands: the mixer's output and the residual [1, K], the norm's weight [K], the
    router's [E + 1, K] (bf16)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(1, gemv.K, generator=g, device="cuda")).to(torch.bfloat16)
    res = (torch.randn(1, gemv.K, generator=g, device="cuda") * 4).to(torch.bfloat16)
    nw = (torch.randn(gemv.K, generator=g, device="cuda") * 0.1).to(torch.bfloat16)
    rw = (torch.randn(E + 1, gemv.K, generator=g, device="cuda") * 0.03).to(torch.bfloat16)
    return x, res, nw, rw


@pytest.mark.parametrize("E,top_k", [(256, 8), (40, 5)])
def test_moe_router_in_the_experts_launch(E, top_k, monkeypatch):
    """moe_router_gate_up_down_e4m3 (KB-0111) against norm.add_rms_norm_router then moe_gate_up(down=),
    three launches in a row (its counts back at zero after each): the new residual the same bits, the logits
    within a bf16 rounding (another summation order; 1e-3 absolute near zero), and where the unfused logits'
    top-k is clear of that (a margin of 4 ulps at the k-th), the same picks, weights within 1e-3 and rows
    within 8e-3."""
    monkeypatch.setenv(gemv.MOE_DOWN_ENV, "1")
    monkeypatch.setenv(gemv.ROUTER_ENV, "1")
    _, _, w, s = _moe_problem(E, top_k, 91, False)
    wd, sd = _down_weights(E, 92)
    kernel = None
    for step in range(3):
        x, res, nw, rw = _router_problem(E, 93 + step)
        assert gemv.wanted_moe_router(x, res, nw, rw, top_k, w, s)
        fused = gemv.moe_router_gate_up(x, res, nw, 1e-6, rw, top_k, w, s, down=(wd, sd))
        got, tw, ids, new_res, logits = fused
        normed, want_res, want_logits = norm.add_rms_norm_router(x, res, nw, 1e-6, rw)
        want, want_tw, want_ids = gemv.moe_gate_up(normed, want_logits, top_k, w, s, down=(wd, sd))
        torch.cuda.synchronize()
        kernel = gemv._kernel(x.device)
        assert not kernel.router_count.any() and not kernel.moe_count.any(), (step, kernel.router_count)
        assert torch.equal(new_res, want_res), step
        lf, wf = logits.float(), want_logits.float()
        # (a bf16 rounding of fp32 sums in two orders; near zero the sums' own error, ~1e-4 for 2,048 terms)
        assert ((lf - wf).abs() <= wf.abs() * 2**-7 + 1e-3).all(), (step, (lf - wf).abs().max())
        top = wf[0, :E].sort(descending=True).values
        if top[top_k - 1] - top[top_k] > 4 * 2**-7 * top[top_k - 1].abs():
            assert torch.equal(ids, want_ids), step
            assert (tw - want_tw).abs().max() < 1e-3, step
            assert rel_rmse(got, want) < 8e-3, step
    monkeypatch.delenv(gemv.ROUTER_ENV)
    assert not gemv.wanted_moe_router(x, res, nw, rw, top_k, w, s)  # off by default (unmeasured)


def test_moe_router_graph_replay(monkeypatch):
    """The fused launch captured in a CUDA graph and replayed with a new mixer output: the eager bits."""
    monkeypatch.setenv(gemv.MOE_DOWN_ENV, "1")
    monkeypatch.setenv(gemv.ROUTER_ENV, "1")
    _, _, w, s = _moe_problem(256, 8, 95, False)
    wd, sd = _down_weights(256, 96)
    x, res, nw, rw = _router_problem(256, 97)

    def step():
        return gemv.moe_router_gate_up(x, res, nw, 1e-6, rw, 8, w, s, down=(wd, sd))

    eager = step()
    out = _captured_with_new_input(step, x)
    again = step()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, again))
    assert not torch.equal(out[3], eager[3])  # a new mixer output, a new residual


@pytest.mark.parametrize("down", [False, True])
def test_moe_own_ring_gives_the_same_bits(down, monkeypatch):
    """The experts' launches from a build with their own ring (METAINFER_WGMMA_GEMV_MOE_SLOTS=6, KB-0113): the
    same bits as the default ring's (a chunk's dots do not depend on the slot it lands in), with and without
    the fused down; the other kernels keep the default ring's build."""
    monkeypatch.delenv(gemv.SLOTS_ENV, raising=False)
    monkeypatch.delenv(gemv.MOE_SLOTS_ENV, raising=False)
    x, logits, w, s = _moe_problem(256, 8, 101, False)
    wd, sd = _down_weights(256, 102)
    monkeypatch.setenv(gemv.MOE_DOWN_ENV, "1")
    kw = dict(down=(wd, sd)) if down else {}
    monkeypatch.setattr(gemv, "_KERNELS", {})
    want = gemv.moe_gate_up(x, logits, 8, w, s, **kw)
    base = gemv._kernel(x.device)
    monkeypatch.setattr(gemv, "_KERNELS", {})
    monkeypatch.setenv(gemv.MOE_SLOTS_ENV, "6")
    got = gemv.moe_gate_up(x, logits, 8, w, s, **kw)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    k6 = gemv._kernel(x.device)
    assert k6.smem_of[k6.moe_fn.value] == base.smem + 2 * 32 * 1024 + 2 * 16 * 4 + 2 * 2 * 8  # 2 more slots
    assert k6.smem_of[k6.fn.value] == base.smem


def test_moe_gate_up_down_graph_replay(monkeypatch):
    """The fused launch captured in a CUDA graph and replayed with new logits: the eager launch's bits."""
    monkeypatch.setenv(gemv.MOE_DOWN_ENV, "1")
    x, logits, w, s = _moe_problem(256, 8, 71, False)
    wd, sd = _down_weights(256, 72)
    eager = gemv.moe_gate_up(x, logits, 8, w, s, down=(wd, sd))  # (builds the kernel outside the capture)

    def step():
        return gemv.moe_gate_up(x, logits, 8, w, s, down=(wd, sd))

    out = _captured_with_new_input(step, logits)
    again = step()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, again))
    assert not torch.equal(out[2], eager[2])  # new logits, new picks
