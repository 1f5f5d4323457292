"""FP8 block quantisation, the FP8 linear kernels (Triton interpreter on the CPU) and the model
conversion / checkpoint placement.

Tolerances (relative RMSE over the output; max-abs relative to the output's max):
- quantise -> dequantise vs the original: rel RMSE < 4e-2 (e4m3 keeps 3 mantissa bits);
- W8A16 kernel vs `ops.fp8_linear`'s reference (dequantise to x's dtype, then F.linear): fp32
  activations rel RMSE < 1e-5, max-abs < 1e-4 (checks the logic); bf16 rel RMSE < 1e-2, max-abs
  < 2e-2 (both round bf16 products differently; the interpreter truncates fp32 -> bf16);
- W8A8 kernel vs the same math in torch (quantised x and W): fp32 < 1e-5, bf16 output < 5e-3;
  vs the dequantised reference: rel RMSE < 6e-2 (per-token-group activation quantisation);
- any FP8 path vs the original BF16/fp32 weights: rel RMSE < 6e-2;
- the tiny engine with --quantization fp8 vs unquantised (CPU, fp32): logits rel RMSE < 5e-2
  (measured ~2e-2), top-1 agreement >= 75%.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from metainfer.kernels import fp8_linear as fl
from metainfer.kernels import ops
from metainfer.kernels import weight_stream as ws
from metainfer.kernels.ops import ref_dequant_fp8
from metainfer.model.fp8 import quantize_fp8_block
from tests.helpers import rel_rmse


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _weight(N: int, K: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(N, 1, generator=g) * 2 + 0.1  # blocks of different magnitude
    return torch.randn(N, K, generator=g) * rows / K**0.5


# ---- quantisation --------------------------------------------------------------------------------
def test_quantize_block_layout():
    w = _weight(200, 300)
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (200, 300)
    assert s.dtype == torch.float32 and s.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert s[i, j] == blk.abs().max() / 448.0
            assert q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float().abs().max() == 448.0
    assert rel_rmse(ref_dequant_fp8(q, s, torch.float32), w) < 4e-2


def test_quantize_batched_and_zero_blocks():
    w = torch.stack([_weight(130, 70, seed=e) for e in range(3)])
    w[1, :128] = 0.0
    q, s = quantize_fp8_block(w.bfloat16())
    assert s.shape == (3, 2, 1)
    for e in range(3):
        qe, se = quantize_fp8_block(w[e].bfloat16())
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(s[e], se)
    assert s[1, 0, 0] == 1.0 and not q[1, :128].float().any()
    assert torch.isfinite(ref_dequant_fp8(q, s, torch.float32)).all()


def _act_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = x.shape
    kb = -(-K // 128)
    xp = F.pad(x.float(), (0, kb * 128 - K)).view(T, kb, 128)
    s = xp.abs().amax(-1).clamp(min=1e-12) / 448.0  # [T, kb]
    q = (xp / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(T, kb * 128)[:, :K]
    return q, s.t().contiguous()


def test_act_quant_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 200, generator=g) * torch.logspace(-3, 2, 5)[:, None]
    # row 0 has amax 448 (scale 1): carries into the exponent, ties, subnormals, saturation edge
    special = torch.tensor([448.0, 31.17, -127.58, 15.5, 2**-10, 3 * 2**-10, -0.013, 447.9, 1e-6, 0.0])
    x[0, : special.numel()] = special
    x[0, special.numel() :] = x[0, special.numel() :].clamp(-400, 400)
    q, s = fl.act_quant(x)
    q_ref, s_ref = _act_quant_ref(x)
    assert s.shape == (2, 5) and torch.allclose(s, s_ref, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), q_ref.float())  # bit-equal but for the sign of zero


# ---- the linear kernels --------------------------------------------------------------------------
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 2e-2)}


def _problem(T: int, N: int = 200, K: int = 300, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    w = _weight(N, K, seed)
    q, s = quantize_fp8_block(w)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    ref = F.linear(x, ref_dequant_fp8(q, s, x.dtype))  # ops.fp8_linear's reference path
    return x, w, q, s, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 16, 17])
def test_fp8_linear_skinny(T, dtype, monkeypatch):
    """The weight-streaming path (17 tokens: with the bound moved to 64)."""
    monkeypatch.setattr(fl, "FP8_STREAM_MAX_T", 64)
    x, w, q, s, ref = _problem(T, dtype=dtype)
    y = fl.fp8_linear(x, q, s)
    assert y.shape == (T, 200) and y.dtype == dtype
    rmse, max_abs = TOL[dtype]
    assert rel_rmse(y, ref) < rmse and _max_rel(y, ref) < max_abs
    assert rel_rmse(y, F.linear(x.float(), w)) < 6e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,block_t", [(1, 1), (1, 16), (5, 16)])
def test_fp8_linear_split_k_fixup(T, block_t, dtype):
    """Split-K fix-up on the CUDA-core (BLOCK_T 1) and tensor-core (BLOCK_T 16, one token padded)
    loops: 5 K steps of 64 or 3 of 128 (the second ragged) over 3 or 2 splits."""
    x, _, q, s, ref = _problem(T, dtype=dtype)
    cfg = ws.skinny_config(T, 200, 300, num_sms=4)
    if block_t == 1:
        cfg.update(BLOCK_N=16, BLOCK_T=1, BLOCK_K=64, SPLIT_K=3, iters_per_split=2)
    else:
        cfg.update(BLOCK_N=32, BLOCK_T=16, BLOCK_K=128, SPLIT_K=2, iters_per_split=2)
    y = torch.empty(T, 200, dtype=x.dtype)
    ws.stream_linear(x, q, s, y, cfg)
    rmse, max_abs = TOL[dtype]
    assert rel_rmse(y, ref) < rmse and _max_rel(y, ref) < max_abs
    assert not ws._LOCKS[ws._lock_key(x.device)][:16].any()  # counters are left at zero
    y2 = torch.empty_like(y)
    ws.stream_linear(x, q, s, y2, cfg)
    assert torch.equal(y, y2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 2])
def test_fp8_linear_tensor_core_256_wide_steps(split, dtype):
    """BLOCK_K 256 on the tensor-core loop: two 128-wide sub-steps per pipelined iteration, each
    with its block scale; K = 300 leaves the second iteration's upper half past K (masked, scale 0)."""
    x, _, q, s, ref = _problem(3, dtype=dtype)
    cfg = ws.skinny_config(3, 200, 300, num_sms=4)
    cfg.update(BLOCK_N=32, BLOCK_T=16, BLOCK_K=256, SPLIT_K=split, iters_per_split=2 // split)
    y = torch.empty(3, 200, dtype=x.dtype)
    ws.stream_linear(x, q, s, y, cfg)
    rmse, max_abs = TOL[dtype]
    assert rel_rmse(y, ref) < rmse and _max_rel(y, ref) < max_abs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,block_t,split", [(1, 1, 1), (1, 1, 3), (1, 16, 2), (5, 16, 1)])
def test_skinny_unquantised_weights(T, block_t, split, dtype):
    """The same weight-streaming kernel on weights in x's dtype (no scales): BF16 projections."""
    w = _weight(200, 300).to(dtype)
    x = torch.randn(T, 300, generator=torch.Generator().manual_seed(3)).to(dtype)
    cfg = ws.skinny_config(T, 200, 300, num_sms=4)
    bk = 64 if block_t == 1 else 128
    k_iters = math.ceil(300 / bk)
    per = math.ceil(k_iters / split)
    cfg.update(BLOCK_N=32, BLOCK_T=block_t, BLOCK_K=bk, SPLIT_K=math.ceil(k_iters / per), iters_per_split=per)
    y = torch.empty(T, 200, dtype=dtype)
    ws.stream_linear(x, w, None, y, cfg)
    ref = F.linear(x, w)
    rmse, max_abs = TOL[dtype]
    assert rel_rmse(y, ref) < rmse and _max_rel(y, ref) < max_abs
    assert torch.equal(ws.dense_linear(x, w), F.linear(x, w))  # CPU tensors: the reference path


CONV_CASES = [(1, 1, 1, 1, True), (1, 1, 3, 1, True), (3, 16, 1, 2, True), (3, 16, 2, 2, False),
              (4, 16, 1, 0, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,block_t,split,B,fp8", CONV_CASES)
def test_skinny_with_conv_epilogue(T, block_t, split, B, fp8, dtype):
    """CONV_K: the DeltaNet decode conv + SiLU as the weight-streaming kernel's epilogue on the
    first C = 136 output columns (not a whole number of 32-wide tiles) of the first B rows (the
    decode rows; later rows are prefill rows and stay raw), one sequence without state; against
    the projection then `reference.causal_conv1d_update` on a copy of the states. Split-K runs the
    epilogue in the fix-up program."""
    from metainfer.kernels import reference as ref

    N, K, C, S, ck = 200, 300, 136, 5, 4
    g = torch.Generator().manual_seed(13)
    w = _weight(N, K, seed=5)
    x = torch.randn(T, K, generator=g).to(dtype)
    cw = (torch.randn(C, ck, generator=g) * 0.5).to(dtype)
    state = torch.randn(S, ck - 1, C, generator=g).to(dtype)
    slots = torch.tensor([3, 0, 4, 1], dtype=torch.int64)[:B]
    has = torch.tensor([True, False, True, True])[:B]
    if fp8:
        q, sc = quantize_fp8_block(w)
        args, y_ref = (q, sc), F.linear(x, ref_dequant_fp8(q, sc, dtype))
    else:
        args, y_ref = (w.to(dtype), None), F.linear(x, w.to(dtype))
    want_state = state.clone()
    want = y_ref.clone()
    if B:
        want[:B, :C] = ref.causal_conv1d_update(y_ref[:B, :C], want_state, cw, slots, has)
    k_iters = math.ceil(K / 64) if block_t == 1 else math.ceil(K / 128)
    per = math.ceil(k_iters / split)
    cfg = dict(BLOCK_N=32, BLOCK_T=block_t, BLOCK_K=64 if block_t == 1 else 128,
               SPLIT_K=math.ceil(k_iters / per), iters_per_split=per, STAGES=2, num_warps=4)
    y = torch.empty(T, N, dtype=dtype)
    ws.stream_linear(x, *args, y, cfg, conv=(cw, state, slots, has))
    rmse, max_abs = TOL[dtype] if dtype == torch.float32 else (3e-2, 6e-2)  # bf16: interpreter truncation
    assert rel_rmse(y, want) < rmse and _max_rel(y, want) < max_abs
    raw = torch.ones_like(y, dtype=torch.bool)
    raw[:B, :C] = False  # outside the decode rows' conv columns: the projection alone
    assert rel_rmse(y[raw], want[raw]) < TOL[dtype][0]
    assert rel_rmse(state, want_state) < TOL[dtype][0]
    untouched = [i for i in range(S) if i not in slots.tolist()]
    assert torch.equal(state[untouched], want_state[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_w8a8(dtype):
    T = ws.SKINNY_MAX_T + 6
    x, w, q, s, ref = _problem(T, N=200, K=300, dtype=dtype)
    y = fl.fp8_linear(x, q, s)
    xq, xs = _act_quant_ref(x)
    x_deq = xq.float() * xs.t().repeat_interleave(128, dim=1)[:, :300]  # per token and 128 columns
    emul = F.linear(x_deq, ref_dequant_fp8(q, s, torch.float32))
    assert rel_rmse(y, emul) < (1e-5 if dtype == torch.float32 else 5e-3)
    assert rel_rmse(y, ref) < 6e-2
    assert rel_rmse(y, F.linear(x.float(), w)) < 6e-2


@pytest.mark.parametrize("bound", [None, 24])
def test_fp8_stream_max_t_moves_mid_batches_to_the_w8a8_gemm(bound, monkeypatch):
    """FP8 projections of more tokens than the bound (FP8_STREAM_MAX_T, 16) take the W8A8 path
    (activations quantised: equal to the torch emulation of it), up to it they stream (W8A16: equal to
    the dequantised reference)."""
    if bound:
        monkeypatch.setattr(fl, "FP8_STREAM_MAX_T", bound)
    bound = fl.FP8_STREAM_MAX_T
    assert ws.FP8_STREAM_MAX_T == 16
    x, _, q, s, ref = _problem(bound + 4, N=200, K=300, dtype=torch.float32)
    xq, xs = _act_quant_ref(x)
    x_deq = xq.float() * xs.t().repeat_interleave(128, dim=1)[:, :300]
    emul = F.linear(x_deq, ref_dequant_fp8(q, s, torch.float32))
    assert rel_rmse(fl.fp8_linear(x, q, s), emul) < 1e-5
    assert rel_rmse(fl.fp8_linear(x[:bound], q, s), ref[:bound]) < 1e-5


def test_fp8_linear_leading_dims_and_asserts():
    x, _, q, s, ref = _problem(4)
    y = fl.fp8_linear(x.view(2, 2, 300), q, s)
    assert y.shape == (2, 2, 200) and torch.equal(y.view(4, 200), fl.fp8_linear(x, q, s))
    with pytest.raises(AssertionError):
        fl.fp8_linear(x, q, s[:1])
    with pytest.raises(AssertionError):
        fl.fp8_linear(x, q.float(), s)


# ---- model conversion and FP8 checkpoints -------------------------------------------------------
# 128-aligned stacked parts like the real model (q/k/v, qkv/z, gate/up): only in_proj b|a is staged
ALIGNED = dict(hidden_size=128, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32,
               moe_intermediate_size=128, shared_expert_intermediate_size=128, mtp_num_hidden_layers=1,
               num_hidden_layers=4)


@pytest.fixture(scope="module")
def aligned_cfg(tmp_path_factory):
    from tests.helpers import write_config

    return write_config(tmp_path_factory.mktemp("fp8_tiny"), **ALIGNED)


def _model(cfg_path, seed: int):
    from metainfer.config import ModelConfig
    from metainfer.model.weights import build_model, init_dummy

    m = build_model(ModelConfig.from_hf(cfg_path), torch.float32, "cpu")
    init_dummy(m, seed)
    return m


def _fp8_tensors(m) -> dict[str, torch.Tensor]:
    from metainfer.model.fp8 import fp8_linears, fp8_moes

    out = {}
    for name, lin in fp8_linears(m):
        out[name], out[name + ".scale"] = lin.weight.data, lin.weight_scale_inv
    for i, moe in enumerate(fp8_moes(m)):
        out[f"moe{i}.gu"], out[f"moe{i}.gus"] = moe.w_gate_up.data, moe.w_gate_up_scale
        out[f"moe{i}.dn"], out[f"moe{i}.dns"] = moe.w_down.data, moe.w_down_scale
    return out


def test_quantize_model_fp8(aligned_cfg):
    from metainfer.model.fp8 import fp8_linears, fp8_moes, quantize_model_fp8

    m = _model(aligned_cfg, seed=0)
    before = {k: v.clone() for k, v in _fp8_tensors(m).items() if not k.endswith(("scale", "gus", "dns"))}
    router, lm_head = m.layers[0].mlp.router.weight.clone(), m.lm_head.weight.clone()
    assert quantize_model_fp8(m) == len(fp8_linears(m)) + 2 * len(fp8_moes(m))
    names = [n for n, _ in fp8_linears(m)]
    assert "mtp.fc" in names and any("in_proj" in n for n in names) and not any("router" in n for n in names)
    after = _fp8_tensors(m)
    for k, w in before.items():
        q, s = after[k], after[k + ".scale"] if k + ".scale" in after else after[k + "s"]
        assert q.dtype == torch.float8_e4m3fn
        assert s.shape[-2:] == (-(-w.shape[-2] // 128), -(-w.shape[-1] // 128))
        assert rel_rmse(ref_dequant_fp8(q, s, torch.float32), w) < 4e-2, k
    r = m.layers[0].mlp.router
    assert r.weight_scale_inv is None and torch.equal(r.weight, router)
    assert m.lm_head.weight_scale_inv is None and torch.equal(m.lm_head.weight, lm_head)
    assert quantize_model_fp8(m) == 0


def test_quantize_model_fp8_lm_head(aligned_cfg):
    """lm_head=True (--fp8-lm-head): the untied lm_head goes FP8 too, once; the logits stay within the
    block quantisation's error of the BF16 head's."""
    from metainfer.model.fp8 import fp8_linears, fp8_moes, quantize_model_fp8

    m = _model(aligned_cfg, seed=0)
    assert not m.cfg.tie_word_embeddings
    h = torch.randn(5, m.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    want = m.compute_logits(h)
    assert quantize_model_fp8(m, lm_head=True) == len(fp8_linears(m)) + 2 * len(fp8_moes(m)) + 1
    assert m.lm_head.weight.dtype == torch.float8_e4m3fn and m.lm_head.weight_scale_inv is not None
    assert m.embed_tokens.weight.dtype != torch.float8_e4m3fn
    got = m.compute_logits(h)
    assert got.dtype == torch.float32 and 0 < rel_rmse(got, want) < 4e-2
    assert quantize_model_fp8(m, lm_head=True) == 0


def test_mtp_draft_head_slices_an_fp8_lm_head(aligned_cfg):
    """The MTP drafts' head over the first N ids (--speculative-draft-vocab) with the lm_head in FP8
    (--fp8-lm-head): the e4m3 rows and their scale blocks sliced, the same logits as the whole FP8
    head's first N columns; N not a multiple of the 128-row scale blocks takes the whole head."""
    from metainfer.model.fp8 import quantize_model_fp8
    from metainfer.spec.mtp import draft_head

    m = _model(aligned_cfg, seed=4)
    quantize_model_fp8(m, lm_head=True)
    assert m.lm_head.weight.dtype == torch.float8_e4m3fn
    h = torch.randn(3, m.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    full = m.compute_logits(h)
    got = draft_head(m, 256)(h)
    assert got.shape == (3, 256) and torch.allclose(got, full[:, :256], rtol=1e-5, atol=1e-5)
    assert draft_head(m, 200) == m.compute_logits and draft_head(m, 0) == m.compute_logits


def test_fp8_checkpoint_loader(aligned_cfg):
    from metainfer.model.fp8 import Fp8CheckpointLoader, prepare_fp8_storage, quantize_model_fp8
    from metainfer.model.weights import _per_expert_targets, hf_state_dict, param_targets

    def views(m):
        return {n: t.view for n, t in {**param_targets(m), **_per_expert_targets(m)}.items()}

    src = _model(aligned_cfg, seed=0)
    probe = _model(aligned_cfg, seed=0)
    prepare_fp8_storage(probe)
    fp8_names = set(Fp8CheckpointLoader(probe, views(probe)).dests)
    ckpt: dict[str, torch.Tensor] = {}  # as a published FP8 checkpoint stores it
    for name, t in hf_state_dict(src, include_mtp=True).items():
        base = name.removesuffix(".weight")
        bf16 = name.endswith(("in_proj_a.weight", "in_proj_b.weight", "1.mlp.shared_expert.down_proj.weight"))
        if bf16 or base not in fp8_names:  # b/a: as published; shared down: BF16 on an aligned part
            ckpt[name] = t.clone()
        elif name == "model.layers.0.mlp.experts.gate_up_proj":  # layer 0: unfused expert keys
            I = t.shape[1] // 2
            for e in range(t.shape[0]):
                for part, rows in (("gate_proj", t[e, :I]), ("up_proj", t[e, I:])):
                    q, s = quantize_fp8_block(rows)
                    ckpt[f"model.layers.0.mlp.experts.{e}.{part}.weight"] = q
                    ckpt[f"model.layers.0.mlp.experts.{e}.{part}.weight_scale_inv"] = s
        else:
            q, s = quantize_fp8_block(t)
            ckpt[name] = q
            ckpt[f"{base}_scale_inv" if "experts." in name else f"{base}.weight_scale_inv"] = s
    dst = _model(aligned_cfg, seed=7)
    prepare_fp8_storage(dst)
    loader, targets = Fp8CheckpointLoader(dst, views(dst)), param_targets(dst)
    for name in sorted(ckpt, reverse=True):  # scales before weights for some tensors
        if not loader.load_tensor(name, ckpt[name]):
            targets[name].hf_view().copy_(ckpt[name])
    loader.finish()
    quantize_model_fp8(src)
    want, got = _fp8_tensors(src), _fp8_tensors(dst)
    for k in want:
        assert torch.equal(want[k].view(torch.uint8) if want[k].dtype != torch.float32 else want[k],
                           got[k].view(torch.uint8) if got[k].dtype != torch.float32 else got[k]), k


def test_engine_fp8_on_cpu(aligned_cfg):
    from metainfer.llm import LLM

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 9)]
    base = LLM(model=f"dummy:{aligned_cfg}", device="cpu", dtype="float32").score(prompts)
    llm = LLM(model=f"dummy:{aligned_cfg}", device="cpu", dtype="float32", quantization="fp8")
    assert llm.engine.runner.model.layers[0].mlp.w_gate_up.dtype == torch.float8_e4m3fn
    assert llm.engine.runner.model.lm_head.weight.dtype == torch.float32  # the published layout
    for a, b in zip(llm.score(prompts), base):
        assert rel_rmse(a, b) < 0.05 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


def test_engine_fp8_lm_head_option(aligned_cfg):
    """fp8_lm_head (--fp8-lm-head): the lm_head in e4m3 too, the logits within the quantisation's error
    of the unquantised engine's; refused without quantization fp8."""
    import argparse

    from metainfer.config import EngineConfig
    from metainfer.generate_cli import add_engine_args, engine_kwargs
    from metainfer.llm import LLM

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (6, 11)]
    base = LLM(model=f"dummy:{aligned_cfg}", device="cpu", dtype="float32").score(prompts)
    llm = LLM(model=f"dummy:{aligned_cfg}", device="cpu", dtype="float32", quantization="fp8",
              fp8_lm_head=True)
    head = llm.engine.runner.model.lm_head
    assert head.weight.dtype == torch.float8_e4m3fn and head.weight_scale_inv is not None
    for a, b in zip(llm.score(prompts), base):
        assert rel_rmse(a, b) < 0.05 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
    with pytest.raises(ValueError, match="fp8_lm_head"):
        EngineConfig(fp8_lm_head=True)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--dtype", "fp8", "--fp8-lm-head"]))
    assert kw["quantization"] == "fp8" and kw["fp8_lm_head"] is True


# every tile config in fp32 with FP8 and unquantised weights; bf16 (the same interpreted program, its
# casts) once by default, the other bf16 cases in CI's slow pass
@pytest.mark.parametrize(
    "T,block_n,ks,preload,fp8,dtype",
    [pytest.param(*c, fp8, dt, marks=() if dt == torch.float32 or (c[0] == 3 and fp8) else pytest.mark.slow)
     for dt in (torch.float32, torch.bfloat16) for fp8 in (True, False)
     for c in ((1, 8, 512, 1), (1, 16, 128, 0), (3, 32, 64, 1), (2, 4, 256, 0))],
)
def test_gemv_kernel(T, block_n, ks, preload, fp8, dtype):
    """`_gemv_kernel` (one weight-tile load per program, before or after the PDL wait): whole-K
    tiles (KS 512 > K = 300) and split-K over ragged 64/128/256-wide slices (3-5 splits, the last
    past K), FP8 block scales or unquantised weights, 1-3 tokens, against the reference projection."""
    x, w, q, s, ref = _problem(T, dtype=dtype)
    args = (q, s) if fp8 else (w.to(dtype), None)
    if not fp8:
        ref = F.linear(x, w.to(dtype))
    cfg = dict(ws.gemv_config(300, T, block_n, ks), PRELOAD=preload)
    assert cfg["SPLIT_K"] == math.ceil(300 / cfg["KS"])
    y = torch.empty(T, 200, dtype=dtype)
    ws.stream_linear(x, *args, y, cfg)
    rmse, max_abs = TOL[dtype]
    assert rel_rmse(y, ref) < rmse and _max_rel(y, ref) < max_abs
    assert not ws._LOCKS[ws._lock_key(x.device)][:64].any()  # split-K counters left at zero
    y2 = torch.empty_like(y)
    ws.stream_linear(x, *args, y2, cfg)
    assert torch.equal(y, y2)  # deterministic fix-up order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("T,Hv,D,N,cfg", [(1, 4, 128, 64, (16, 4, 4)), (1, 4, 128, 40, (8, 2, 4)),
                                          (1, 4, 128, 24, (16, 1, 4)), (2, 4, 32, 24, (16, 2, 4))])
def test_gated_norm_linear(T, Hv, D, N, cfg, fp8, dtype, monkeypatch):
    """`_gnorm_gemv_kernel`: the DeltaNet gated RMSNorm as out_proj's prologue, on the CUDA cores one token
    at a time: whole-K programs and 2-4 way split-K over heads (the fix-up), N not a multiple of the row
    tiles, FP8 block scales (D = 128) or unquantised weights, strided z rows, against gated_rms_norm then
    F.linear; `gnorm_ok` (the plan's check) refuses T past GNORM_MAX_T tokens (2 tokens: with the bound
    moved) and heads per program not a power of two, which the launcher then refuses too."""
    if fp8 and D != 128:
        pytest.skip("FP8: a head is one 128-column scale block")
    from metainfer.kernels import reference as ref

    tiles = dict(zip(("BLOCK_N", "HEADS", "num_warps"), cfg))
    monkeypatch.setattr(ws, "gnorm_config", lambda N, Hv, fp8: dict(tiles))
    monkeypatch.setattr(ws, "GNORM_MAX_T", T)
    g = torch.Generator().manual_seed(T * 10 + Hv)
    core = torch.randn(T, Hv, D, generator=g).to(dtype)
    z = torch.randn(T, 2 * Hv * D, generator=g).to(dtype)[:, Hv * D :].view(T, Hv, D)
    gw = 1 + 0.1 * torch.randn(D, generator=g)  # fp32, as the checkpoint's norm weight
    w = _weight(N, Hv * D, seed=T)
    q, s = quantize_fp8_block(w) if fp8 else (w.to(dtype), None)
    wd = ref_dequant_fp8(q, s, dtype) if fp8 else q
    want = F.linear(ref.gated_rms_norm(core, z, gw, 1e-6).view(T, Hv * D), wd)
    got = ws.gated_norm_linear(core, z, gw, 1e-6, q, s)
    rmse, max_abs = (1e-6, 1e-5) if dtype == torch.float32 else (2e-2, 8e-2)  # the interpreter truncates bf16
    assert got.dtype == dtype and rel_rmse(got, want) < rmse and _max_rel(got, want) < max_abs
    assert not ws._LOCKS[ws._lock_key(core.device)][:64].any()  # split-K counters left at zero
    assert ws.gnorm_ok(T, Hv, D, N, fp8, q.dtype == dtype)
    monkeypatch.setattr(ws, "GNORM_MAX_T", T - 1)
    assert not ws.gnorm_ok(T, Hv, D, N, fp8, q.dtype == dtype)
    with pytest.raises(AssertionError):
        ws.gated_norm_linear(core, z, gw, 1e-6, q, s)
    monkeypatch.setattr(ws, "GNORM_MAX_T", T)
    tiles.update(HEADS=3)
    assert not ws.gnorm_ok(T, Hv, D, N, fp8, q.dtype == dtype)
    with pytest.raises(AssertionError):
        ws.gated_norm_linear(core, z, gw, 1e-6, q, s)


@pytest.mark.parametrize("T,ks", [(1, 512), (3, 128)])
def test_gemv_kernel_with_the_conv_epilogue(T, ks):
    """The shared `_store_tile` epilogue on the GEMV kernel: the DeltaNet conv on the first C columns of the
    decode rows, as on `_skinny_kernel`."""
    from metainfer.kernels import reference as ref

    N, K, C, S, ck, dtype = 200, 300, 136, 5, 4, torch.float32
    g = torch.Generator().manual_seed(23)
    w = _weight(N, K, seed=7)
    q, sc = quantize_fp8_block(w)
    x = torch.randn(T, K, generator=g)
    cw = torch.randn(C, ck, generator=g) * 0.5
    state = torch.randn(S, ck - 1, C, generator=g)
    slots, has = torch.tensor([2, 4], dtype=torch.int64)[:min(T, 2)], torch.tensor([True, False])[:min(T, 2)]
    want = F.linear(x, ref_dequant_fp8(q, sc, dtype))
    want_state = state.clone()
    B = slots.shape[0]
    want[:B, :C] = ref.causal_conv1d_update(want[:B, :C].clone(), want_state, cw, slots, has)
    y = torch.empty(T, N, dtype=dtype)
    ws.stream_linear(x, q, sc, y, ws.gemv_config(K, T, 16, ks), conv=(cw, state, slots, has))
    assert rel_rmse(y, want) < TOL[dtype][0] and rel_rmse(state, want_state) < TOL[dtype][0]


def test_stream_config_prefers_the_gemv_entry(monkeypatch):
    """A "gemv:" table entry serves the shape before its skinny entry; BF16 without an entry: None."""
    key = "200,300,1"
    skinny = dict(BLOCK_N=64, BLOCK_T=1, BLOCK_K=256, SPLIT_K=1, iters_per_split=2, STAGES=2, num_warps=4)
    table = {f"gemv:{key}": ws.gemv_config(300, 1, 16, 512), key: skinny}
    monkeypatch.setattr(ws, "tuned_table", lambda: table)
    dev = torch.device("cpu")
    assert "KS" in ws.stream_config(1, 200, 300, True, dev)
    del table[f"gemv:{key}"]
    assert ws.stream_config(1, 200, 300, True, dev)["BLOCK_K"] == 256
    assert ws.stream_config(1, 200, 300, False, dev) is None


def test_tuned_row_takes_the_nearest_wider_measurement():
    """A decode batch between measured token counts takes the config measured at the fewest tokens
    above it (less than 2x) whose tile holds it; an exact key wins; nothing wider: the heuristic."""
    table = {"200,300,32": dict(BLOCK_T=32, tag="t32"), "200,300,64": dict(BLOCK_T=64, tag="t64"),
             "200,300,40": dict(BLOCK_T=32, tag="tile too small"), "bf16:200,300,32": dict(BLOCK_T=32),
             "gemv:200,300,48": dict(BLOCK_T=64), "100,300,24": dict(BLOCK_T=32)}
    pick = lambda T: (ws.tuned_row(table, 200, 300, T) or {}).get("tag")  # noqa: E731
    assert [pick(T) for T in (16, 17, 24, 32, 33, 40, 48, 64, 65, 128)] == [
        None, "t32", "t32", "t32", "t64", "tile too small", "t64", "t64", None, None]


@pytest.mark.parametrize("T", [1, 5, 32])
def test_aligned_linear_pads_unaligned_rows(T):
    """The router's 257 output rows: zero-padded to a multiple of 8, the first 257 columns returned
    as a strided view; same values as F.linear, the padding made once per weight."""
    g = torch.Generator().manual_seed(T)
    w = torch.randn(257, 96, generator=g)
    x = torch.randn(T, 96, generator=g)
    y = ws.aligned_linear(x, w)
    assert y.shape == (T, 257) and y.stride() == (264, 1)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    pad = w._aligned_rows[1]
    assert pad.shape == (264, 96) and torch.equal(pad[257:], torch.zeros(7, 96))
    ws.aligned_linear(x, w)
    assert w._aligned_rows[1] is pad  # made once
    w.mul_(2.0)  # written in place (a reload): padded again
    torch.testing.assert_close(ws.aligned_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x3 = x.view(1, T, 96)
    torch.testing.assert_close(ws.aligned_linear(x3, w), F.linear(x3, w), rtol=1e-5, atol=1e-5)


def test_aligned_linear_on_an_inference_tensor():
    with torch.inference_mode():
        w = torch.randn(13, 16)
    x = torch.randn(3, 16)
    torch.testing.assert_close(ws.aligned_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert ws.aligned_linear(x, w).stride(0) == 16


def test_wgmma_gemv_only_on_cuda():
    """cuda/gemv.cu serves one CUDA token only (tests/gpu/test_gemv_gpu.py runs it): on the CPU fp8_linear
    keeps its Triton path; the conv epilogue variant and the experts' gate/up likewise."""
    from metainfer.kernels.cuda import gemv

    x = torch.zeros(1, gemv.K, dtype=torch.bfloat16)
    w = torch.zeros(144, gemv.K, dtype=torch.float8_e4m3fn)
    s = torch.ones(2, gemv.K // 128)
    assert not gemv.wanted(x, w, s)
    cw = torch.zeros(128, gemv.CONV_K, dtype=torch.bfloat16)
    state = torch.zeros(2, gemv.CONV_K - 1, 128, dtype=torch.bfloat16)
    assert not gemv.wanted_conv(x, w, s, cw, state, torch.zeros(1, dtype=torch.int64))
    w4, s4 = torch.zeros(144, 4096, dtype=torch.float8_e4m3fn), torch.ones(2, 32)  # K = 2,048 only
    assert not gemv.wanted(torch.zeros(1, 4096, dtype=torch.bfloat16), w4, s4)
    wm, sm = torch.zeros(9, 1024, gemv.K, dtype=torch.float8_e4m3fn), torch.ones(9, 8, gemv.K // 128)
    assert not gemv.wanted_moe(x, torch.zeros(1, 9, dtype=torch.bfloat16), 4, wm, sm)


def test_pending_norm_materializes_where_no_kernel_takes_it():
    """`layers.PendingNorm` (a decode token's input norm left to its projection's prologue, gemv.cu's on
    the GPU): on the CPU no kernel takes it, so `Linear.forward` / `conv_forward` run the norm first, with
    the same output and new residual as `RMSNorm.add_forward`; the CPU's plans never build one."""
    from metainfer.model.layers import ExpertRows, Linear, PendingNorm, RMSNorm

    g = torch.Generator().manual_seed(7)
    H, W = 256, 9
    rows = ExpertRows(torch.randn(1, W, H, generator=g), torch.rand(1, W, generator=g), torch.bfloat16)
    residual = torch.randn(1, H, generator=g).bfloat16()
    norm = RMSNorm(H, 1e-6)
    norm.weight.data = (0.1 * torch.randn(H, generator=g)).bfloat16()
    want_h, want_res = norm.add_forward(rows, residual)
    lin = Linear(H, {"w": 384})
    w32 = torch.randn(384, H, generator=g) * 0.05
    lin.weight.data, lin.weight_scale_inv = quantize_fp8_block(w32)
    w = ops.LayerWeights(True, True, torch.bfloat16, True)  # FP8 experts and projections, BF16 router
    assert ops.step_plan(1, True, w, torch.bfloat16, residual.device).input_norm == "norm"  # no kernel
    pn = PendingNorm(rows, residual, norm.weight, norm.eps, torch.empty_like(residual))
    assert pn.shape == residual.shape and pn.dtype == torch.bfloat16
    assert torch.equal(lin(pn), lin(want_h)) and torch.equal(pn.new_res, want_res)
    cw, state = torch.randn(128, 4, generator=g).bfloat16(), torch.randn(2, 3, 128, generator=g).bfloat16()
    slots, has = torch.tensor([1]), torch.tensor([True])
    s1, s2 = state.clone(), state.clone()
    pn2 = PendingNorm(rows, residual, norm.weight, norm.eps, torch.empty_like(residual))
    got = lin.conv_forward(pn2, cw, s1, slots, has)
    assert torch.equal(got, lin.conv_forward(want_h, cw, s2, slots, has)) and torch.equal(s1, s2)
    assert torch.equal(pn2.new_res, want_res)


def test_gemv_timeline_build_is_a_load_switch(monkeypatch):
    """`use_timeline_build` picks the build gemv.cu loads as next (the default build unless asked); anything
    but -DNAME[=VALUE] is refused by the build before nvcc runs."""
    from metainfer.kernels.cuda import gemv, launch

    assert gemv._TIMELINE is False
    monkeypatch.setattr(gemv, "_TIMELINE", False)
    gemv.use_timeline_build()
    assert gemv._TIMELINE
    gemv.use_timeline_build(False)
    assert not gemv._TIMELINE
    with pytest.raises(ValueError):
        launch.build(main="gemv.cu", defines=("-UGEMV_TIMELINE",))
