"""Norm, conv1d, gdn_decode and paged-attention kernels at full Qwen3.6-35B-A3B shapes on CUDA (bf16),
CUDA-graph replay of the decode kernels, and an sm_90 compile check that runs without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from metainfer.forward_meta import ForwardMeta
from metainfer.kernels import reference as ref

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"
H, HK, DK, HV, DV, K = 2048, 16, 128, 32, 128, 4
C = 2 * HK * DK + HV * DV
HQ, HKV, D = 16, 2, 256
BF16 = (4e-3, 6e-2)  # (relative RMSE, max abs): about 2 bf16 ulps at |x| < 8 for elementwise kernels
ATTN = (1e-2, 3e-2)  # attention vs the fp32 reference on the same bf16 inputs
CONV = (8e-3, 1e-1)  # the reference rounds each tap product to bf16; the kernel sums exact products in fp32


def rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def close(got, want, rr, ma):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got.float()).all()
    err, mx = rel_rmse(got, want), (got.float() - want.float()).abs().max().item()
    assert err < rr and mx < ma, (err, mx)


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


# ---- norms ---------------------------------------------------------------------------------------
@cuda
@pytest.mark.parametrize("T", [1, 33, 257, 4099])
def test_norms_full_shapes(T):
    from metainfer.kernels import norm

    g = gen(T)
    x = torch.randn(T, H, device=DEV, generator=g).bfloat16()
    r = torch.randn(T, H, device=DEV, generator=g).bfloat16()
    w = (0.1 * torch.randn(H, device=DEV, generator=g)).bfloat16()
    close(norm.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), *BF16)
    out, new_r = norm.add_rms_norm(x, r, w, 1e-6)
    want_out, want_r = ref.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(new_r, want_r)
    close(out, want_out, *BF16)
    qg = torch.randn(T, HQ, 2 * D, device=DEV, generator=g).bfloat16()
    wq = (0.1 * torch.randn(D, device=DEV, generator=g)).bfloat16()
    close(norm.rms_norm(qg[..., :D], wq, 1e-6), ref.rms_norm(qg[..., :D], wq, 1e-6), *BF16)
    core = torch.randn(T, HV, DV, device=DEV, generator=g).bfloat16()
    zz = torch.randn(T, 2 * HV * DV, device=DEV, generator=g).bfloat16()
    z = zz[:, HV * DV :].view(T, HV, DV)
    wn = (1 + 0.1 * torch.randn(DV, device=DEV, generator=g)).bfloat16()
    close(norm.gated_rms_norm(core, z, wn, 1e-6), ref.gated_rms_norm(core, z, wn, 1e-6), *BF16)


@cuda
@pytest.mark.parametrize("T", [1, 2, 5, 8, 16])
def test_add_rms_norm_router_full_shapes(T, monkeypatch):
    """The post-attention norm with the MoE router [257, 2048] in one launch: the norm's outputs equal
    `add_rms_norm`'s bits (same math; residual exactly), logits within a bf16 rounding of F.linear's."""
    from metainfer.kernels import norm

    monkeypatch.setattr(norm, "ROUTER_MAX_T", 16)  # the kernel's rows past the engine's bound too
    g = gen(100 + T)
    x = torch.randn(T, H, device=DEV, generator=g).bfloat16()
    r = torch.randn(T, H, device=DEV, generator=g).bfloat16()
    w = (0.1 * torch.randn(H, device=DEV, generator=g)).bfloat16()
    rw = (torch.randn(257, H, device=DEV, generator=g) / H**0.5).bfloat16()
    out, new_r, logits = norm.add_rms_norm_router(x, r, w, 1e-6, rw)
    want_out, want_r = norm.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(new_r, want_r)
    close(out, want_out, 1e-3, 2e-2)  # the same math; the row sum's order may differ by an ulp
    close(logits, torch.nn.functional.linear(want_out, rw), *BF16)


@cuda
@pytest.mark.parametrize("T", [17, 1024, 4099])
def test_norm_quant_copies_full_shapes(T):
    """KB-0052 at full shapes on the GPU: each norm's e4m3 copy (xq_out) has the bits `act_quant` gives
    for the norm's stored output (add+norm, the MoE rows' add+norm, the DeltaNet gated norm)."""
    from metainfer.kernels import fp8_linear, norm

    g = gen(T + 1)
    x = torch.randn(T, H, device=DEV, generator=g).bfloat16() * 4
    r = torch.randn(T, H, device=DEV, generator=g).bfloat16()
    w = (0.1 * torch.randn(H, device=DEV, generator=g)).bfloat16()
    rows = torch.randn(T, 8, H, device=DEV, generator=g).bfloat16()
    tw = torch.rand(T, 8, device=DEV, generator=g)
    core = torch.randn(T, HV, DV, device=DEV, generator=g).bfloat16()
    z = torch.randn(T, 2 * HV * DV, device=DEV, generator=g).bfloat16()[:, HV * DV :].view(T, HV, DV)
    wn = (1 + 0.1 * torch.randn(DV, device=DEV, generator=g)).bfloat16()
    cases = {
        "add_rms_norm": lambda xq: norm.add_rms_norm(x, r, w, 1e-6, xq_out=xq)[0],
        "moe_add_rms_norm": lambda xq: norm.moe_add_rms_norm(rows, tw, r, w, 1e-6, xq_out=xq)[0],
        "gated_rms_norm": lambda xq: norm.gated_rms_norm(core, z, wn, 1e-6, xq_out=xq).view(T, HV * DV),
    }
    bad = {}
    for name, fn in cases.items():
        xq = fp8_linear.act_buffers(T, H if name != "gated_rms_norm" else HV * DV, DEV)
        out = fn(xq)
        q, s = fp8_linear.act_quant(out)
        qd = (xq[0][:T].view(torch.uint8) != q.view(torch.uint8)).sum().item()
        sd = (xq[1][:, :T] != s).sum().item()
        od = (out != fn(None)).sum().item()  # the kernel without the copy (another compile) stores the same
        if qd or sd or od:
            bad[name] = (qd, sd, (xq[1][:, :T] / s - 1).abs().max().item(), od)
    assert not bad, bad  # name: (e4m3 bytes, scales that differ, their largest gap, outputs that differ)


# ---- DeltaNet decode -----------------------------------------------------------------------------
def _deltanet_inputs(B, S, seed):
    g = gen(seed)
    mixed = torch.randn(B, C + 4096, device=DEV, generator=g).bfloat16()[:, :C]  # strided rows
    conv_state = torch.randn(S, K - 1, C, device=DEV, generator=g).bfloat16()
    conv_w = (0.5 * torch.randn(C, K, device=DEV, generator=g)).bfloat16()
    ssm = 0.5 * torch.randn(S, HV, DK, DV, device=DEV, generator=g)
    slots = torch.randperm(S, device=DEV, generator=g)[:B]
    has = torch.rand(B, device=DEV, generator=g) > 0.2
    gdec = -2 * torch.rand(B, HV, device=DEV, generator=g)
    beta = torch.rand(B, HV, device=DEV, generator=g).bfloat16()
    return mixed, conv_state, conv_w, ssm, slots, has, gdec, beta


def _gdn_ref(q, k, v, g, beta, state, slots, has):
    init = state[slots] * has[:, None, None, None].float()
    out, final = ref.gated_delta_rule_recurrent(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], init
    )
    state = state.clone()
    state[slots] = final
    return out[:, 0], state


@cuda
def test_conv_prefill_full_shape(monkeypatch):
    """The varlen prefill conv at the model's 8,192 channels: sequences
    of 1,000, 3 and 4,000 tokens (one without state) against `reference.causal_conv1d`."""
    from metainfer.kernels import conv1d

    g = gen(41)
    qsl, slots, has = [0, 1000, 1003, 5003], [4, 1, 7], [True, False, True]
    x = torch.randn(qsl[-1], C, device=DEV, generator=g).bfloat16()
    state = torch.randn(9, K - 1, C, device=DEV, generator=g).bfloat16()
    w = (torch.randn(C, K, device=DEV, generator=g) * 0.5).bfloat16()
    want_state = state.clone()
    want = ref.causal_conv1d(x, want_state, w, qsl, slots, has)
    got = conv1d.causal_conv1d(x, state, w, qsl, slots, has, torch.tensor(qsl, dtype=torch.int32, device=DEV),
                               torch.tensor(slots, device=DEV), torch.tensor(has, device=DEV))
    close(got, want, *CONV)
    assert torch.equal(state, want_state)


@cuda
@pytest.mark.parametrize("B", [1, 7, 64, 256])
def test_conv_and_gdn_full_shapes(B):
    from metainfer.kernels import conv1d, gdn_decode

    mixed, conv_state, conv_w, ssm, slots, has, gdec, beta = _deltanet_inputs(B, B + 9, seed=B)
    want_state = conv_state.clone()
    want = ref.causal_conv1d_update(mixed, want_state, conv_w, slots, has)
    y = conv1d.causal_conv1d_update(mixed, conv_state, conv_w, slots, has)
    close(y, want, *CONV)
    assert torch.equal(conv_state, want_state)

    q, k, v = torch.split(y, [HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.view(B, HK, DK), k.view(B, HK, DK), v.view(B, HV, DV)
    for _ in range(3):  # chained steps through the in-place state
        want_out, want_ssm = _gdn_ref(q, k, v, gdec, beta, ssm, slots, has)
        out = gdn_decode.gdn_decode(q, k, v, gdec, beta, ssm, slots, has)
        close(out, want_out, *BF16)
        assert rel_rmse(ssm, want_ssm) < 1e-5 and (ssm - want_ssm).abs().max() < 1e-3
        ssm.copy_(want_ssm)
        has = torch.ones_like(has)


@cuda
@pytest.mark.parametrize("B", [1, 64])
def test_gdn_bf16_state_full_shapes(B):
    """--ssm-state-dtype bfloat16: the decode kernel on bf16 state storage (fp32 math) against the
    fp32-state update of the same rounded states, rounded (one bf16 rounding: rel. RMSE < 5e-3)."""
    from metainfer.kernels import gdn_decode

    mixed, _, _, ssm, slots, has, gdec, beta = _deltanet_inputs(B, B + 9, seed=B + 1)
    q, k, v = torch.split(mixed, [HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.view(B, HK, DK), k.view(B, HK, DK), v.view(B, HV, DV)
    s16 = ssm.to(torch.bfloat16)
    want_out, want_ssm = _gdn_ref(q, k, v, gdec, beta, s16.float(), slots, has)
    out = gdn_decode.gdn_decode(q, k, v, gdec, beta, s16, slots, has)
    close(out, want_out, *BF16)
    assert s16.dtype == torch.bfloat16 and rel_rmse(s16.float(), want_ssm) < 5e-3


# ---- paged attention -----------------------------------------------------------------------------
def _attn_setup(query_lens, context_lens, bs, seed, max_blocks=None, num_blocks=None):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    need = [-(-n // bs) for n in seq_lens]
    N = num_blocks or sum(need) + 4
    assert N > sum(need)
    perm = (torch.randperm(N - 1, generator=g) + 1).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    meta = ForwardMeta.build(
        query_lens=query_lens, context_lens=context_lens, block_tables=tables,
        state_slots=list(range(len(query_lens))), block_size=bs, logits_rows=[], device=DEV,
        max_blocks=max_blocks,
    )
    gd = gen(seed)
    kc = torch.randn(N, bs, HKV, D, device=DEV, generator=gd).bfloat16()
    vc = torch.randn(N, bs, HKV, D, device=DEV, generator=gd).bfloat16()
    q = torch.randn(sum(query_lens), HQ, D, device=DEV, generator=gd).bfloat16()
    return q, kc, vc, meta


def _attn_ref(q, kc, vc, meta):
    """fp32 reference on the same bf16 inputs, cast to bf16."""
    out = ref.paged_attention(
        q.float(), kc.float(), vc.float(), meta.block_tables, meta.query_start_loc_cpu, meta.seq_lens_cpu,
        D**-0.5,
    )
    return out.bfloat16()


@cuda
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1], [8191]),
        ([1] * 5, [0, 99, 1000, 4096, 7999]),
        ([1, 1, 1000, 512, 1], [30, 2047, 0, 3000, 17]),
        ([257, 63], [0, 1]),
    ],
)
@pytest.mark.parametrize("bs", [16, 32])
def test_paged_attention_full_shapes(query_lens, context_lens, bs):
    from metainfer.kernels import attention

    q, kc, vc, meta = _attn_setup(query_lens, context_lens, bs, seed=len(query_lens) * bs)
    close(attention.paged_attention(q, kc, vc, meta, D**-0.5), _attn_ref(q, kc, vc, meta), *ATTN)


@cuda
@pytest.mark.parametrize("decode_cfg", [{}, dict(block_n=32, min_split_tokens=32),
                                        dict(block_n=16, min_split_tokens=16)])
@pytest.mark.parametrize("context_lens", [[1055], [0, 99, 1000, 4096, 7999, 63]])
def test_decode_configs_full_shapes(context_lens, decode_cfg, monkeypatch):
    """The decode config (attention.DECODE) and smaller key tiles / more splits, the reduce over the splits
    with keys only: the same bound against the reference."""
    from metainfer.kernels import attention

    monkeypatch.setattr(attention, "DECODE", attention.DecodeConfig(**decode_cfg))
    q, kc, vc, meta = _attn_setup([1] * len(context_lens), context_lens, 16, seed=len(context_lens))
    close(attention.paged_attention(q, kc, vc, meta, D**-0.5), _attn_ref(q, kc, vc, meta), *ATTN)


@cuda
@pytest.mark.parametrize(
    "query_lens,context_lens", [([5], [1000]), ([1, 1, 5, 3, 16], [30, 2047, 4000, 37, 0])]
)
def test_paged_attention_prefill_split_full_shapes(query_lens, context_lens):
    """Split-KV prefill: short chunks (a verify's 1 + K) split their keys across programs, merged by the
    reduce kernel; same bound as the unsplit ones."""
    from metainfer.kernels import attention

    q, kc, vc, meta = _attn_setup(query_lens, context_lens, 16, seed=sum(query_lens))
    assert attention.prefill_num_splits(max(query_lens), kc.shape[2], meta.block_tables.shape[1] * 16) > 1
    close(attention.paged_attention(q, kc, vc, meta, D**-0.5), _attn_ref(q, kc, vc, meta), *ATTN)


# ---- CUDA graphs ---------------------------------------------------------------------------------
@cuda
def test_decode_kernels_graph_replay_matches_eager():
    """Capture with one batch layout, rewrite the device buffers with another (same B and
    block-table width), replay: equal to the eager kernels on the new layout."""
    from metainfer.kernels import attention, conv1d, gdn_decode

    B, bs, width = 6, 16, 8192 // 16
    layout = dict(bs=bs, max_blocks=width, num_blocks=1024)
    q, kc, vc, meta = _attn_setup([1] * B, [5, 100, 17, 2000, 0, 700], seed=1, **layout)
    mixed, conv_state, conv_w, ssm, slots, has, gdec, beta = _deltanet_inputs(B, 16, seed=2)

    def step():
        o = attention.paged_attention(q, kc, vc, meta, D**-0.5)
        y = conv1d.causal_conv1d_update(mixed, conv_state, conv_w, slots, has)
        qq, kk, vv = torch.split(y, [HK * DK, HK * DK, HV * DV], dim=-1)
        s = gdn_decode.gdn_decode(qq.view(B, HK, DK), kk.view(B, HK, DK), vv.view(B, HV, DV), gdec, beta, ssm,
                                  slots, has)
        return o, y, s

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    q2, kc2, vc2, meta2 = _attn_setup([1] * B, [3000, 1, 64, 8000, 15, 0], seed=3, **layout)
    for dst, src in ((q, q2), (kc, kc2), (vc, vc2), (meta.seq_lens, meta2.seq_lens),
                     (meta.block_tables, meta2.block_tables)):
        dst.copy_(src)
    mixed.normal_()
    conv_state.normal_()
    ssm.normal_()
    has.copy_(torch.tensor([True, False, True, True, False, True], device=DEV))
    conv_before, ssm_before = conv_state.clone(), ssm.clone()
    graph.replay()
    torch.cuda.synchronize()
    graph_outs = [t.clone() for t in outs]
    graph_conv, graph_ssm = conv_state.clone(), ssm.clone()
    conv_state.copy_(conv_before)
    ssm.copy_(ssm_before)
    eager = step()  # meta still carries the captured host fields; only num_decodes is read
    for a, b in zip(graph_outs, eager):
        assert torch.equal(a, b)
    assert torch.equal(graph_conv, conv_state) and torch.equal(graph_ssm, ssm)
    close(graph_outs[0], _attn_ref(q, kc, vc, meta2), *ATTN)


# ---- sm_90 code generation (no GPU needed) -------------------------------------------------------
_COMPILE = textwrap.dedent(
    """
    import inspect
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from metainfer.kernels import attention as A, conv1d, gdn_decode, moe, norm, routing
    from metainfer.kernels import fp8_linear as fl, moe_grouped as mg, weight_stream as ws

    def build(kernel, types, consts, num_warps, num_stages=2):
        # constexpr parameters left out take their defaults, as in a launch
        defaults = {p.name: p.default for p in kernel.params
                    if p.is_constexpr and p.default is not inspect.Parameter.empty}
        consts = dict(defaults, **consts, USE_PDL=1)  # the launch-with-PDL build (griddepcontrol) for sm_90
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
        # two specialisations, as the JIT makes them: pointers 16-byte aligned and the integers
        # unknown (scalar loads), and every integer a multiple of 16 too (the full model's shapes
        # and strides: vectorised cp.async pipelines)
        for ints in (False, True):
            div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
                   if sig[n][0] == "*" or sig[n] == "i64" or (ints and sig[n] == "i32")}
            src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=div)
            triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, "num_stages": num_stages})

    bf, f32 = "*bf16", "*fp32"
    build(norm._rms_norm_kernel, dict(x_ptr=bf, w_ptr=bf, out_ptr=bf, eps="fp32", sx0="i64", sx1="i64"),
          dict(BLOCK_R=2, BLOCK_N=2048), norm.NUM_WARPS)
    qa = dict(q_ptr="*fp8e4nv", s_ptr=f32)  # the norm's e4m3 copy (QUANT=1)
    for quant in (0, 1):
        build(norm._add_rms_norm_kernel,
              dict(x_ptr=bf, res_ptr=bf, w_ptr=bf, out_ptr=bf, new_res_ptr=bf, eps="fp32", **qa),
              dict(BLOCK_R=2, BLOCK_N=2048, QUANT=quant), norm.NUM_WARPS)
    # per-pair rows fp32, the grouped rows bf16 (with the e4m3 copy: prefill)
    for has_res, yt, quant in ((0, f32, 0), (1, f32, 0), (1, bf, 0), (1, bf, 1)):
        build(norm._moe_add_rms_norm_kernel,
              dict(y_ptr=yt, tw_ptr=f32, res_ptr=bf, w_ptr=bf, out_ptr=bf, new_res_ptr=bf, eps="fp32", **qa),
              dict(SLOTS=9, HAS_RES=has_res, BLOCK_R=2, BLOCK_N=2048, QUANT=quant), norm.NUM_WARPS)
    for block_r, warps in ((1, 4), (8, 8)):  # the post-attention norm with the MoE router (decode)
        build(norm._add_rms_norm_router_kernel, dict(x_ptr=bf, res_ptr=bf, w_ptr=bf, rw_ptr=bf, out_ptr=bf,
              new_res_ptr=bf, logits_ptr=bf, eps="fp32"), dict(BLOCK_R=block_r, BLOCK_N=2048,
              BLOCK_E=norm.ROUTER_BLOCK_E), warps)
    for quant in (0, 1):
        build(norm._gated_rms_norm_kernel, dict(x_ptr=bf, z_ptr=bf, w_ptr=bf, out_ptr=bf, eps="fp32", **qa),
              dict(MID=tl.bfloat16, BLOCK_R=32, BLOCK_N=128, QUANT=quant), norm.NUM_WARPS)
    build(conv1d._conv_prefill_kernel, dict(x_ptr=bf, state_ptr=bf, w_ptr=bf, out_ptr=bf, cu_ptr="*i32",
          slots_ptr="*i64", has_ptr="*u8"), dict(K=4, KP=4, Y_DT=tl.bfloat16, BLOCK_T=conv1d.PREFILL_BLOCK_T,
          BLOCK_C=conv1d.PREFILL_BLOCK_C), 4)
    build(conv1d._conv_update_kernel, dict(x_ptr=bf, state_ptr=bf, w_ptr=bf, out_ptr=bf, slots_ptr="*i64",
          has_ptr="*u8"), dict(K=4, Y_DT=tl.bfloat16, BLOCK_C=conv1d.BLOCK_C), conv1d.NUM_WARPS)
    for gated in (False, True):
        build(gdn_decode._gdn_decode_kernel,
              dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, g_ptr=bf if gated else f32, beta_ptr=bf, state_ptr=f32,
                   slots_ptr="*i64", has_ptr="*u8", out_ptr=bf, alog_ptr=bf, dtb_ptr=bf, scale="fp32"),
              dict(HV=32, REP=2, DK=128, DV=128, BLOCK_K=128, BLOCK_V=gdn_decode.BLOCK_V, GATED=gated),
              gdn_decode.NUM_WARPS)
    dc, pc = A.DECODE, A.PREFILL
    for split, gate in ((False, 0), (False, 1), (True, 0)):
        build(A._decode_split_kernel, dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, bt_ptr="*i32", seq_lens_ptr="*i32",
              out_ptr=bf, part_o_ptr=f32, part_lse_ptr=f32, gate_ptr=bf, scale_log2="fp32"),
              dict(HQ=16, G=8, G_PAD=16, D=256, BLOCK_D=256, BLOCK_SIZE=16, BLOCK_N=dc.block_n, SPLIT=split,
                   PREC="tf32", UPCAST=False, GATE=gate), dc.num_warps, dc.num_stages)
    for gate in (0, 1):
        build(A._decode_reduce_kernel, dict(part_o_ptr=f32, part_lse_ptr=f32, out_ptr=bf, gate_ptr=bf),
              dict(HQ=16, D=256, BLOCK_D=256, CHUNK=dc.reduce_chunk, GATE=gate), 4)
        # the decode reduce: the splits with keys only, chunks of 16 and 32
        for chunk in (dc.reduce_chunk, 32):
            build(A._decode_reduce_kernel, dict(part_o_ptr=f32, part_lse_ptr=f32, out_ptr=bf, gate_ptr=bf,
                  seq_lens_ptr="*i32"), dict(HQ=16, D=256, BLOCK_D=256, CHUNK=chunk, GATE=gate,
                  ACTIVE_N=dc.block_n), 4)
        for split in (0, 1):  # split-KV for short chunks
            build(A._prefill_kernel, dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, out_ptr=bf, gate_ptr=bf,
                  bt_ptr="*i32", qsl_ptr="*i32", seq_lens_ptr="*i32", scale_log2="fp32", part_o_ptr=f32,
                  part_lse_ptr=f32),
                  dict(HQ=16, G=8, G_P2=8, D=256, BLOCK_D=256, BLOCK_SIZE=16, BLOCK_M=pc.block_rows // 8,
                       BLOCK_N=pc.block_n, SPLIT=split, PREC="tf32", UPCAST=False, GATE=gate),
                  pc.num_warps, pc.num_stages)
    f8 = "*fp8e4nv"
    for bt, f16, bk, ck in ((1, 0, 128, 0), (16, 1, 128, 0), (16, 1, 256, 0),
                            (16, 1, 128, 4), (1, 0, 256, 4)):
        build(ws._skinny_kernel, dict(x_ptr=bf, w_ptr=f8, s_ptr=f32, y_ptr=bf, part_ptr=f32, lock_ptr="*i32",
              cstate_ptr=bf, cw_ptr=bf, slots_ptr="*i64", has_ptr="*u8"), dict(SPLIT_K=2, BLOCK_N=32,
              BLOCK_T=bt, BLOCK_K=bk, STAGES=5, UPCAST=0, DOT_F16=f16, CONV_K=ck, Y_DT=tl.bfloat16), 4)
    for fp8, bn, heads in ((1, 16, 32), (1, 16, 16), (0, 8, 32)):  # gated norm + out_proj, one token
        build(ws._gnorm_gemv_kernel, dict(core_ptr=bf, z_ptr=bf, gw_ptr=f32, weight_ptr=f8 if fp8 else bf,
              wscale_ptr=f32 if fp8 else bf, y_ptr=bf, part_ptr=f32, lock_ptr="*i32", eps="fp32"),
              dict(SPLIT_K=32 // heads, BLOCK_N=bn, BLOCK_T=1, HEADS=heads, D=128, MID=tl.float32,
                   HAS_SCALE=fp8), 8)
    gv = dict(x_ptr=bf, weight_ptr=f8, wscale_ptr=f32, y_ptr=bf, part_ptr=f32, lock_ptr="*i32", cstate_ptr=bf,
              cw_ptr=bf, slots_ptr="*i64", has_ptr="*u8")
    for bn, bt, ks, split, ck, w in ((8, 1, 2048, 1, 4, 8), (8, 1, 4096, 1, 0, 4), (16, 4, 512, 4, 0, 4)):
        build(ws._gemv_kernel, gv, dict(SPLIT_K=split, BLOCK_N=bn, BLOCK_T=bt, KS=ks, CONV_K=ck,
              Y_DT=tl.bfloat16), w)
    for fp8, mma, route in ((0, 0, 0), (1, 0, 0), (1, 1, 0), (0, 0, 8), (1, 0, 8)):
        wt = f8 if fp8 else bf
        build(moe._pair_gate_up_kernel, dict(x_ptr=bf, w_ptr=wt, s_ptr=f32, ids_ptr="*i64", act_ptr=bf,
              logits_ptr=bf, tw_ptr=f32), dict(SLOTS=9, FP8=fp8, BLOCK_I=16, BLOCK_K=128, STAGES=4, MMA=mma,
              UPCAST=0, DOT_F16=mma, ROUTE_K=route, E_P2=256, K_P2=8), 2)
        build(moe._pair_down_rows_kernel, dict(act_ptr=bf, w_ptr=wt, s_ptr=f32, ids_ptr="*i64", y_ptr=f32),
              dict(FP8=fp8, BLOCK_H=32, BLOCK_K=128, STAGES=4, MMA=mma, UPCAST=0, DOT_F16=mma), 2)
    # the bucketed (prefill) path, FP8 weights and e4m3 activations
    idx = dict(sorted_ptr="*i32", ends_ptr="*i32", counts_ptr="*i32")
    tiles = dict(FP8=1, UPCAST=0, E_P2=256, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128)
    for desc in (None, "tensordesc<fp8e4nv[64,128]>"):  # weight tiles by pointer loads, by TMA
        wd, wc = (dict(w_desc=desc), {}) if desc else ({}, dict(w_desc=None))
        gu_types = dict(idx, x_ptr=f8, w_ptr=f8, s_ptr=f32, act_ptr=bf, xs_ptr=f32, **wd)
        dn_types = dict(idx, act_ptr=f8, w_ptr=f8, s_ptr=f32, y_ptr=bf, as_ptr=f32, **wd)
        for swap in (0, 1):  # SWAP: weights as the MMA's M side
            build(mg._grouped_gate_up_kernel, gu_types, dict(tiles, TOP_K=8, SWAP=swap, **wc), 4, 3)
            build(mg._grouped_down_kernel, dn_types, dict(tiles, SWAP=swap, **wc), 4, 3)
    for bm in (16, 64):  # the down kernel's e4m3 input: valid rows only (and act_quant's kernel)
        build(mg._valid_rows_quant_kernel,
              dict(x_ptr=bf, q_ptr=f8, s_ptr=f32, ends_ptr="*i32", counts_ptr="*i32"),
              dict(BLOCK_M=bm, E_P2=256, BLOCK_T=16), 4)
    build(fl._act_quant_kernel, dict(x_ptr=bf, q_ptr=f8, s_ptr=f32), dict(BLOCK_T=16), 4)
    build(mg._bucket_one_kernel, dict(ids_ptr="*i64", counts_ptr="*i32", ends_ptr="*i32", sorted_ptr="*i32"),
          dict(BLOCK_M=16, E_P2=512, BLOCK=1024), 8)
    build(moe._routed_down_kernel, dict(act_ptr=bf, w_ptr=f8, s_ptr=f32, logits_ptr=bf, y_ptr=f32),
          dict(SLOTS=9, ROUTE_K=8, FP8=1, BLOCK_H=32, I_P2=512, E_P2=256, K_P2=8), 4)
    build(moe._routed_down_kernel, dict(act_ptr=bf, w_ptr=f8, s_ptr=f32, logits_ptr="*i64", y_ptr=f32),
          dict(SLOTS=9, ROUTE_K=0, FP8=1, BLOCK_H=32, I_P2=512, E_P2=1, K_P2=1), 4)  # from the route's ids
    build(routing._combine_kernel, dict(y_ptr=f32, tw_ptr=f32, out_ptr=bf), dict(TOP_K=9, BLOCK_H=1024), 4)
    build(routing._route_kernel, dict(logits_ptr=bf, w_ptr=f32, ids_ptr="*i64"),
          dict(TOP_K=8, E_P2=256, K_P2=8, SHARED=1), 4)
    from metainfer.kernels import decode_io as dio  # the decode graph's glue
    i64 = "*i64"
    build(dio._decode_inputs_kernel, dict(packed=i64, stride_p="i64", tok_buf=i64, ctx="*i32", seq="*i32"),
          dict(BLOCK=1), 4)
    for xt in (bf, f32):
        build(dio._argmax_chunks_kernel, dict(x=xt, stride_x="i64", pv=f32, pi="*i32"),
              dict(BLOCK=dio.CHUNK), 4)
    build(dio._argmax_rows_kernel, dict(pv=f32, pi="*i32", out=i64), dict(NCH_P2=128), 1)
    print("ok")
    """
)


@pytest.mark.slow  # minutes of sm_90 compilation on a CPU: CI's second pass
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on a GPU the kernel tests compile and run every kernel")
def test_kernels_compile_for_sm90():
    """Every kernel at the full-model constexprs compiles to sm_90 cubin (ptxas ships with Triton):
    a CPU-only machine's check that the GPU build of each kernel is valid."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    if res.returncode and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("no ptxas in this Triton install")
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
