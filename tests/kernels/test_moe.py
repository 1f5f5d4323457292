"""Routed-expert kernels (Triton interpreter on the CPU) against `ops.moe_experts`' reference.

Tiny odd shapes: H=160 (two FP8 column blocks, the second ragged), I=48 (not a multiple of any
block), E=8, k=2; T = 1, 3 (decode path), 3, 17 (bucketed path, 16-row M-blocks).
Tolerances vs the reference (relative RMSE; max-abs relative to max |ref|):
- fp32 activations and weights (checks the kernels' logic): rel RMSE < 1e-5, max-abs < 1e-4;
- bf16: rel RMSE < 1.5e-2, max-abs < 3e-2. The reference rounds gate/up, silu, each product and the
  running sum to bf16, the kernels round the activation, each expert output and the result; the
  interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest), which doubles the
  kernels' share (on the GPU tests/gpu asserts 1e-2);
- FP8 weights vs the dequantise-then-reference path: the same; FP8 vs the unquantised weights:
  rel RMSE < 6e-2.
"""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import moe, moe_grouped, routing
from metainfer.kernels import reference as ref
from metainfer.kernels.ops import ref_dequant_fp8
from metainfer.model.fp8 import quantize_fp8_block
from tests.helpers import rel_rmse

H, I, E, K = 160, 48, 8, 2


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1.5e-2, 3e-2)}


def _problem(T: int, seed: int = 0, skew: bool = False, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w_gu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w_dn = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    logits = torch.randn(T, E, generator=g) * 2
    if skew:  # most tokens on expert 3: several M-blocks for one expert, others empty
        logits[:, 3] += 6
    tw, ids = ref.route(logits, K)
    return x, w_gu, w_dn, tw, ids


F32, BF16 = torch.float32, torch.bfloat16
CASES = [(1, "pair", F32), (3, "pair", F32), (3, "grouped", F32), (17, "grouped", F32),
         (3, "pair", BF16), (17, "grouped", BF16)]


@pytest.mark.parametrize("T,path,dtype", CASES)
def test_moe_unquantised(T, path, dtype):
    x, w_gu, w_dn, tw, ids = _problem(T, dtype=dtype)
    want = ref.moe_experts(x, w_gu, w_dn, tw, ids)
    got = moe.moe_experts(x, w_gu, w_dn, tw, ids, path=path)
    assert got.shape == want.shape and got.dtype == want.dtype
    rmse, max_abs = TOL[dtype]
    assert rel_rmse(got, want) < rmse and _max_rel(got, want) < max_abs


@pytest.mark.parametrize("T,path,dtype", [c for c in CASES if c[1] == "pair"])
def test_moe_fp8(T, path, dtype):
    """Weight-only FP8 (the per-pair path; the grouped path's e4m3 activations: the test below)."""
    x, w_gu, w_dn, tw, ids = _problem(T, seed=1, dtype=dtype)
    q_gu, s_gu = quantize_fp8_block(w_gu)
    q_dn, s_dn = quantize_fp8_block(w_dn)
    dq_gu, dq_dn = ref_dequant_fp8(q_gu, s_gu, x.dtype), ref_dequant_fp8(q_dn, s_dn, x.dtype)
    want = ref.moe_experts(x, dq_gu, dq_dn, tw, ids)
    got = moe.moe_experts(x, q_gu, q_dn, tw, ids, s_gu, s_dn, path=path)
    rmse, max_abs = TOL[dtype]
    assert rel_rmse(got, want) < rmse and _max_rel(got, want) < max_abs
    exact = ref.moe_experts(x.float(), w_gu.float(), w_dn.float(), tw, ids)
    assert rel_rmse(got, exact) < 6e-2


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Per-(row, 128-column) e4m3 quantise + dequantise in fp32 (act_quant's scheme)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    for c in range(0, x.shape[1], 128):
        blk = x[:, c : c + 128].float()
        sc = blk.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
        out[:, c : c + 128] = (blk / sc).to(torch.float8_e4m3fn).float() * sc
    return out


@pytest.mark.parametrize("skew", [pytest.param(False, marks=pytest.mark.slow), True])  # skew: the odder one
def test_moe_grouped_w8a8(skew):
    """The grouped path's FP8: e4m3 x e4m3 (activations quantised per token and 128 columns, the SiLU*up
    activation too): against the same quantisation applied in an fp32 reference (rel RMSE < 1e-3: an
    activation on an e4m3 rounding boundary may round the other way), and within 8% of the weight-only
    FP8 reference."""
    x, w_gu, w_dn, tw, ids = _problem(17, seed=2, skew=skew, dtype=F32)
    (q_gu, s_gu), (q_dn, s_dn) = quantize_fp8_block(w_gu), quantize_fp8_block(w_dn)
    dq_gu, dq_dn = ref_dequant_fp8(q_gu, s_gu, F32), ref_dequant_fp8(q_dn, s_dn, F32)
    got = moe.moe_experts(x, q_gu, q_dn, tw, ids, s_gu, s_dn, path="grouped")
    xd = _fake_quant(x)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            gu = dq_gu[e] @ xd[t]
            act = torch.nn.functional.silu(gu[:I]) * gu[I:]
            want[t] += tw[t, j] * (dq_dn[e] @ _fake_quant(act[None])[0])
    assert rel_rmse(got, want) < 1e-3
    assert rel_rmse(got, ref.moe_experts(x, dq_gu, dq_dn, tw, ids)) < 8e-2


MMA_CFG = dict(BLOCK_I=16, BLOCK_H=32, BLOCK_K=128, STAGES=2, num_warps=4, DOWN="rows", MMA=1)


@pytest.mark.parametrize(  # each T/dtype and each weight kind once by default, the rest in CI's slow pass
    "T,dtype,fp8",
    [(1, F32, False), pytest.param(1, F32, True, marks=pytest.mark.slow),
     pytest.param(3, BF16, False, marks=pytest.mark.slow), (3, BF16, True)],
)
def test_moe_pair_tensor_core_variant(T, dtype, fp8):
    """The pair path's MMA variant (the activation as column 0 of a 16-wide operand)."""
    x, w_gu, w_dn, tw, ids = _problem(T, seed=4, dtype=dtype)
    args, ref_w = (x, w_gu, w_dn, tw, ids), (w_gu, w_dn)
    if fp8:
        (q_gu, s_gu), (q_dn, s_dn) = quantize_fp8_block(w_gu), quantize_fp8_block(w_dn)
        args = (x, q_gu, q_dn, tw, ids, s_gu, s_dn)
        ref_w = (ref_dequant_fp8(q_gu, s_gu, dtype), ref_dequant_fp8(q_dn, s_dn, dtype))
    want = ref.moe_experts(x, *ref_w, tw, ids)
    got = moe.moe_experts(*args, path="pair", config=MMA_CFG)
    fma = moe.moe_experts(*args, path="pair", config=dict(MMA_CFG, MMA=0))
    rmse, max_abs = TOL[dtype]
    assert rel_rmse(got, want) < rmse and _max_rel(got, want) < max_abs
    assert rel_rmse(got, fma) < rmse


def test_moe_skewed_buckets_deterministic():
    x, w_gu, w_dn, tw, ids = _problem(20, seed=2, skew=True)
    assert (ids == 3).sum() > 16  # expert 3 spans two M-blocks
    want = ref.moe_experts(x, w_gu, w_dn, tw, ids)
    a = moe.moe_experts(x, w_gu, w_dn, tw, ids.int(), path="grouped")
    b = moe.moe_experts(x, w_gu, w_dn, tw, ids, path="grouped")
    assert rel_rmse(a, want) < TOL[BF16][0] and torch.equal(a, b)


def test_moe_bucket_layout():
    _, _, _, _, ids = _problem(17, seed=3)
    P, bm = ids.numel(), 16
    counts = torch.zeros(2 * E, dtype=torch.int32)
    ends = torch.empty(E, dtype=torch.int32)
    max_blocks = (P + min(E, P) * (bm - 1)) // bm
    sorted_pairs = torch.full((max_blocks * bm,), -1, dtype=torch.int32)
    moe_grouped._count_kernel[(1,)](ids, counts, P, BLOCK=64)
    moe_grouped._bucket_kernel[(2,)](ids, counts, counts[E:], ends, sorted_pairs, P, E, BLOCK_M=bm, E_P2=8,
                                     BLOCK=32)
    want = torch.bincount(ids.flatten(), minlength=E)
    assert torch.equal(counts[:E].long(), want) and torch.equal(counts[E:].long(), want)
    padded = (want + bm - 1) // bm * bm
    assert torch.equal(ends.long(), padded.cumsum(0))
    for e in range(E):
        seg = sorted_pairs[ends[e] - padded[e] : ends[e] - padded[e] + want[e]].long()
        assert sorted(seg.tolist()) == torch.nonzero(ids.flatten() == e).flatten().tolist()


@pytest.mark.parametrize("T,bm,skew", [(17, 16, False), (5, 16, True), (40, 32, True)])
def test_moe_bucket_one_program_layout(T, bm, skew):
    """`_bucket_one_kernel` (P <= BLOCK pairs, one launch, counts zeroed inside: the buffer starts
    as garbage) lays the pairs out as the two-launch count + bucket: the same counts, ends and
    per-expert sets of pairs."""
    _, _, _, _, ids = _problem(T, seed=4, skew=skew)
    P = ids.numel()
    max_blocks = (P + min(E, P) * (bm - 1)) // bm
    counts = torch.full((E,), 12345, dtype=torch.int32)
    ends = torch.empty(E, dtype=torch.int32)
    sorted_pairs = torch.full((max_blocks * bm,), -1, dtype=torch.int32)
    moe_grouped._bucket_one_kernel[(1,)](ids, counts, ends, sorted_pairs, P, E, BLOCK_M=bm, E_P2=8, BLOCK=128)
    want = torch.bincount(ids.flatten(), minlength=E)
    assert torch.equal(counts.long(), want)
    padded = (want + bm - 1) // bm * bm
    assert torch.equal(ends.long(), padded.cumsum(0))
    for e in range(E):
        seg = sorted_pairs[ends[e] - padded[e] : ends[e] - padded[e] + want[e]].long()
        assert sorted(seg.tolist()) == torch.nonzero(ids.flatten() == e).flatten().tolist()


def test_moe_grouped_one_bucket_launch_equals_two(monkeypatch):
    x, w_gu, w_dn, tw, ids = _problem(17, seed=6, skew=True)
    one = moe.moe_experts(x, w_gu, w_dn, tw, ids, path="grouped")
    monkeypatch.setattr(moe_grouped, "BUCKET_ONE_MAX", 0)  # the two-launch bucketing of wider steps
    two = moe.moe_experts(x, w_gu, w_dn, tw, ids, path="grouped")
    assert torch.equal(one, two)


def test_moe_asserts():
    x, w_gu, w_dn, tw, ids = _problem(2)
    q_gu, s_gu = quantize_fp8_block(w_gu)
    with pytest.raises(AssertionError):
        moe.moe_experts(x, q_gu, w_dn, tw, ids, s_gu, None)
    with pytest.raises(AssertionError):
        moe.moe_experts(x, w_gu, w_dn, tw.bfloat16(), ids)
    assert moe.moe_experts(x[:0], w_gu, w_dn, tw[:0], ids[:0]).shape == (0, H)


@pytest.mark.parametrize("T,E_,k", [(1, 8, 2), (17, 8, 2), (5, 256, 8), (3, 20, 3)])
def test_route_topk(T, E_, k):
    g = torch.Generator().manual_seed(T)
    logits = torch.randn(T, E_ + 1, generator=g) * 3
    logits = (logits if E_ > 64 else logits.bfloat16())[:, :E_]  # strided rows, like the model's
    w, ids = routing.route_topk(logits, k)
    w_ref, ids_ref = ref.route(logits, k)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref) and torch.allclose(w, w_ref, rtol=1e-5, atol=1e-7)


def test_route_ties_pick_the_lowest_index():
    """Integer logits (many exact ties at the 8th pick): the routing picks the lowest index among
    equal probabilities, as a stable sort does, with the same weights; and the routing gate/up
    kernel's slots agree."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(-2, 3, (3, 257), generator=g).float()
    logits[2, :] = 1.0  # all equal: experts 0..7
    w, ids = routing.route_topk(logits, 8, shared=True)
    p = logits[:, :256].softmax(-1)
    want = torch.argsort(-p, dim=-1, stable=True)[:, :8]
    assert torch.equal(ids[:, :8], want) and torch.equal(ids[2, :8], torch.arange(8))
    top = p.gather(1, want)
    assert torch.allclose(w[:, :8], top / top.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    x = torch.randn(3, H, generator=g)
    w_gu = torch.randn(257, 2 * I, H, generator=g) / H**0.5
    w_dn = torch.randn(257, H, I, generator=g) / I**0.5
    rows, tw = moe.moe_routed_rows(x, logits, 8, True, w_gu, w_dn)
    assert torch.equal(tw, w)
    assert rel_rmse(rows, ref.moe_expert_rows(x, w_gu, w_dn, ids)) < 1e-5


def test_route_picks_rank_logits_signed_zeros_tie():
    """The picks rank the logits (KB-0096): -0.0 and +0.0 are one value (the lowest index first), and a
    non-power-of-two k leaves no weight in the padding slots."""
    logits = torch.full((1, 12), -1.0)
    logits[0, 7], logits[0, 2], logits[0, 9] = -0.0, 0.0, 0.5
    w, ids = routing.route_topk(logits, 3)
    assert ids.tolist() == [[9, 2, 7]]
    p = logits.softmax(-1)[0, [9, 2, 7]]
    assert torch.allclose(w[0], p / p.sum(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("T", [1, 3])
def test_moe_pair_down_variants_agree(T):
    x, w_gu, w_dn, tw, ids = _problem(T, seed=5, dtype=F32)
    want = ref.moe_experts(x, w_gu, w_dn, tw, ids)
    for down in ("rows", "fused"):
        cfg = {**moe.pair_config(T), "DOWN": down}
        got = moe.moe_experts(x, w_gu, w_dn, tw, ids, path="pair", config=cfg)
        assert rel_rmse(got, want) < 1e-5, down


@pytest.mark.parametrize("T", [1, 4])
def test_route_with_shared_slot(T):
    g = torch.Generator().manual_seed(T)
    logits = (torch.randn(T, E + 1, generator=g) * 3).bfloat16()
    w, ids = routing.route_topk(logits, K, shared=True)
    w_ref, ids_ref = ref.route_with_shared(logits, K)
    assert w.shape == (T, K + 1) and torch.equal(ids, ids_ref)
    assert torch.allclose(w, w_ref, rtol=1e-5, atol=1e-7)
    assert torch.all(ids[:, K] == E)


def test_moe_with_shared_expert_slot_matches_separate_shared_mlp():
    """The shared expert stored as expert E, gated by sigmoid(logit E), equals the separate MLP."""
    T = 3
    x, w_gu, w_dn, _, _ = _problem(T, seed=6, dtype=F32)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(T, E + 1, generator=g)
    s_gu = torch.randn(1, 2 * I, H, generator=g) / H**0.5
    s_dn = torch.randn(1, H, I, generator=g) / I**0.5
    tw, ids = ref.route(logits[:, :E], K)
    gate, up = torch.nn.functional.linear(x, s_gu[0]).chunk(2, dim=-1)
    shared = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, s_dn[0])
    want = ref.moe_experts(x, w_gu, w_dn, tw, ids) + torch.sigmoid(logits[:, E:]) * shared
    tw2, ids2 = ref.route_with_shared(logits, K)
    got = moe.moe_experts(x, torch.cat([w_gu, s_gu]), torch.cat([w_dn, s_dn]), tw2, ids2, path="pair")
    assert rel_rmse(got, want) < 1e-5


SLOW = pytest.mark.slow  # run by CI's slow pass: the same interpreted program as a case kept by default


# T=3 fp32 in every variant; T=1 and bf16 once each (shared expert and FP8), the rest in the slow pass
@pytest.mark.parametrize(
    "T,dtype,shared,fp8",
    [pytest.param(T, dt, shared, fp8, marks=() if T == 3 and dt == F32 or shared and fp8 else SLOW)
     for T, dt in ((1, F32), (3, F32), (3, BF16)) for shared in (False, True) for fp8 in (False, True)],
)
def test_moe_routed_rows(T, dtype, shared, fp8):
    """Routing inside the gate/up kernel: the same ids and weights as `route_topk`, each pair's
    unweighted output as `reference.moe_expert_rows`, and their weighted sum as `moe_experts` (the down
    kernel routes from the logits itself and loads its weights before the PDL wait)."""
    g = torch.Generator().manual_seed(20 + T)
    x, w_gu, w_dn, _, _ = _problem(T, seed=8, dtype=dtype)
    n = E + int(shared)
    if shared:  # one more expert, stored last, and the gate's logit
        w_gu = torch.cat([w_gu, (torch.randn(1, 2 * I, H, generator=g) / H**0.5).to(dtype)])
        w_dn = torch.cat([w_dn, (torch.randn(1, H, I, generator=g) / I**0.5).to(dtype)])
    logits = (torch.randn(T, n + 1, generator=g) * 3).to(dtype)[:, :n]  # strided rows, as the router's split
    tw_want, ids = (ref.route_with_shared if shared else ref.route)(logits, K)
    args, ref_w = (w_gu, w_dn), (w_gu, w_dn)
    if fp8:
        (q_gu, s_gu), (q_dn, s_dn) = quantize_fp8_block(w_gu), quantize_fp8_block(w_dn)
        args = (q_gu, q_dn, s_gu, s_dn)
        ref_w = (ref_dequant_fp8(q_gu, s_gu, dtype), ref_dequant_fp8(q_dn, s_dn, dtype))
    rows, tw = moe.moe_routed_rows(x, logits, K, shared, *args)
    assert rows.shape == (T, K + int(shared), H) and rows.dtype == F32
    assert torch.allclose(tw, tw_want, rtol=1e-5, atol=1e-7)
    want = ref.moe_expert_rows(x, *ref_w, ids)
    rmse, max_abs = TOL[dtype]
    assert rel_rmse(rows, want) < rmse and _max_rel(rows, want) < max_abs
    summed = ref.moe_combine(rows, tw, dtype)
    full = ref.moe_experts(x, *ref_w, tw_want, ids)
    assert rel_rmse(summed, full) < rmse


def test_moe_routed_rows_asserts():
    x, w_gu, w_dn, _, _ = _problem(2)
    logits = torch.randn(2, E)
    with pytest.raises(AssertionError):  # logits for E experts, weights say E + 1 with a shared one
        moe.moe_routed_rows(x, logits, K, True, torch.cat([w_gu, w_gu[:1]]), torch.cat([w_dn, w_dn[:1]]))
    with pytest.raises(AssertionError):  # past the per-pair decode path
        moe.moe_routed_rows(torch.zeros(64, H), torch.zeros(64, E), K, False, w_gu, w_dn)



def test_routed_rows_bound():
    """moe_routed_rows serves FP8 batches up to ROUTED_MAX_T tokens (a verify of 1 + 4 tokens is past it)."""
    assert moe.routed_rows_ok(moe.ROUTED_MAX_T, True) and not moe.routed_rows_ok(moe.ROUTED_MAX_T + 1, True)
    assert not moe.routed_rows_ok(0, True)
    assert not moe.routed_rows_ok(1, False)  # BF16 experts route in their own launch


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("T,dtype", [(1, F32), (3, BF16)])
def test_moe_pair_rows(T, dtype, fp8):
    """The per-pair kernels from given ids (the router-epilogue routing): each pair's unweighted
    output as `reference.moe_expert_rows`."""
    x, w_gu, w_dn, _, ids = _problem(T, seed=9, dtype=dtype)
    args, ref_w = (w_gu, w_dn), (w_gu, w_dn)
    if fp8:
        (q_gu, s_gu), (q_dn, s_dn) = quantize_fp8_block(w_gu), quantize_fp8_block(w_dn)
        args = (q_gu, q_dn, ids, s_gu, s_dn)
        ref_w = (ref_dequant_fp8(q_gu, s_gu, dtype), ref_dequant_fp8(q_dn, s_dn, dtype))
    else:
        args = (w_gu, w_dn, ids)
    rows = moe.moe_pair_rows(x, *args)
    want = ref.moe_expert_rows(x, *ref_w, ids)
    rmse, max_abs = TOL[dtype]
    assert rows.shape == (T, K, H) and rel_rmse(rows, want) < rmse and _max_rel(rows, want) < max_abs


def _shared_problem(T: int, seed: int, dtype: torch.dtype, fp8: bool):
    """`_problem` with the shared expert as expert E (slot K, routed by logit E), the next norm's
    residual and weight: -> (x, w_gu, w_dn, residual, norm weight, tw, ids, FP8 scales or ())."""
    x, w_gu, w_dn, _, _ = _problem(T, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(T)
    shared_gu = (torch.randn(1, 2 * I, H, generator=g) / H**0.5).to(dtype)  # the shared expert: id E
    shared_dn = (torch.randn(1, H, I, generator=g) / I**0.5).to(dtype)
    w_gu, w_dn = torch.cat([w_gu, shared_gu]), torch.cat([w_dn, shared_dn])
    logits = torch.randn(T, E + 1, generator=g) * 2
    residual, nw = torch.randn(T, H, generator=g).to(dtype), torch.randn(H, generator=g).to(dtype)
    tw, ids = routing.route_topk(logits, K, shared=True)
    scales = ()
    if fp8:
        (w_gu, s_gu), (w_dn, s_dn) = quantize_fp8_block(w_gu), quantize_fp8_block(w_dn)
        scales = (s_gu, s_dn)
    return x, w_gu, w_dn, residual, nw, tw, ids, scales


@pytest.mark.parametrize(  # bf16 unquantised runs the program of the bf16 FP8 case: slow pass only
    "T,dtype,fp8", [(1, F32, 0), (5, F32, 0), pytest.param(8, BF16, 0, marks=SLOW), (12, BF16, 1)]
)
def test_route_then_pair_rows_summed_by_the_norm_equals_combine(T, dtype, fp8):
    """`ops.moe_pair_rows`' wiring (KB-0035): the route launch (shared slot), the per-pair rows, their
    weighted sum inside `moe_add_rms_norm` == route, `moe_experts` (pair path, the combine launch),
    `add_rms_norm`: the same fp32 slot-order sum rounded once (rel. RMSE < 1e-6)."""
    from metainfer.kernels import norm

    x, w_gu, w_dn, residual, nw, tw, ids, scales = _shared_problem(T, 3, dtype, fp8)
    rows = moe.moe_pair_rows(x, w_gu, w_dn, ids, *scales)
    got = norm.moe_add_rms_norm(rows, tw, residual, nw, 1e-6)
    combined = moe.moe_experts(x, w_gu, w_dn, tw, ids, *scales, path="pair")
    want = norm.add_rms_norm(combined, residual, nw, 1e-6)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == dtype and rel_rmse(a, b) < 1e-6


@pytest.mark.parametrize("T,dtype,fp8", [(17, F32, 0), (19, BF16, 0), (20, BF16, 1)])
def test_grouped_rows_summed_by_the_norm_equal_combine(T, dtype, fp8):
    """`ops.moe_grouped_rows` (past the per-pair path): the grouped GEMMs' rows (x's dtype, pair order) summed
    inside `moe_add_rms_norm` == `moe_experts`' grouped path with its combine launch, then
    `add_rms_norm`: the same fp32 slot-order sum of the same rounded rows, rounded once (exact)."""
    from metainfer.kernels import norm

    x, w_gu, w_dn, residual, nw, tw, ids, scales = _shared_problem(T, 5, dtype, fp8)
    assert moe.grouped_rows_ok(T, bool(fp8)) and not moe.use_pair_path(T, bool(fp8))
    rows = moe.moe_grouped_rows(x, w_gu, w_dn, ids, *scales)
    assert rows.shape == (T, K + 1, H) and rows.dtype == dtype
    got = norm.moe_add_rms_norm(rows, tw, residual, nw, 1e-6)
    combined = moe.moe_experts(x, w_gu, w_dn, tw, ids, *scales, path="grouped")
    want = norm.add_rms_norm(combined, residual, nw, 1e-6)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)


@pytest.mark.parametrize("T", [3, 17])
def test_moe_rows_ops_serve_small_and_wide_batches(T, monkeypatch):
    """The plan's "pair_rows" (small batches) and "grouped_rows" (past the per-pair path) ops: the route
    launch's weights and each pair's rows (the combine launch saved)."""
    from metainfer.kernels import ops, registry

    kernels = registry.load()
    monkeypatch.setattr(ops, "_kernel", lambda name, x: kernels.get(name))  # the GPU dispatch, on the CPU
    x, w_gu, w_dn, _, _ = _problem(T, seed=2, dtype=F32)
    w_gu, w_dn = torch.cat([w_gu, w_gu[:1]]), torch.cat([w_dn, w_dn[:1]])
    logits = torch.randn(T, E + 1, generator=torch.Generator().manual_seed(1))
    rows_op = ops.moe_pair_rows if moe.use_pair_path(T, False) else ops.moe_grouped_rows
    got = rows_op(x, logits, K, w_gu, w_dn)
    assert got[0].shape == (T, K + 1, H) and got[0].dtype == F32
    tw, ids = routing.route_topk(logits, K, shared=True)
    assert torch.equal(got[1], tw)
    want = moe.moe_experts(x, w_gu, w_dn, tw, ids)
    assert rel_rmse(torch.einsum("tw,twh->th", tw, got[0].float()), want.float()) < 1e-5


@pytest.mark.parametrize("fp8", [False, True])
def test_moe_grouped_tma_weights(fp8, monkeypatch):
    """A config's TMA=1 (the weight tiles by TMA descriptor, `moe_grouped.tma_ok`'s shapes: N and K
    tiles that divide the experts' rows) gives the pointer-load kernels' result exactly."""
    g = torch.Generator().manual_seed(7)
    h, i, e, T = 256, 64, 8, 19
    x = torch.randn(T, h, generator=g).to(BF16)
    w_gu = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(BF16)
    w_dn = (torch.randn(e, h, i, generator=g) / i**0.5).to(BF16)
    tw, ids = ref.route(torch.randn(T, e, generator=g) * 2, K)
    args = (x, w_gu, w_dn, tw, ids)
    if fp8:
        (q_gu, s_gu), (q_dn, s_dn) = quantize_fp8_block(w_gu), quantize_fp8_block(w_dn)
        args = (x, q_gu, q_dn, tw, ids, s_gu, s_dn)
    cfg = dict(BLOCK_M=16, GU_BLOCK_N=32, DN_BLOCK_N=64, BLOCK_K=128 if fp8 else 64, num_warps=4,
               num_stages=2)
    assert moe_grouped.tma_ok(args[1], args[2], 32, 64)  # K = 64 < BLOCK_K 128 for FP8's down: zeros past K
    want = moe.moe_experts(*args, path="grouped", config=dict(cfg, TMA=0))
    got = moe.moe_experts(*args, path="grouped", config=dict(cfg, TMA=1))
    assert torch.equal(got, want)
    assert not moe_grouped.tma_ok(args[1], args[2], 48, 64)  # a tile across two experts' rows


@pytest.mark.parametrize("bm, K", [(16, 512), (32, 200)])
def test_quant_valid_rows_equals_act_quant(bm, K):
    """The down kernel's e4m3 input quantised on the bucketed rows that hold pairs only: those rows'
    q and s equal act_quant's bit for bit (an empty bucket, partial buckets, K not a multiple of
    128, NaN padding rows and a tail past the last bucket)."""
    from metainfer.kernels.fp8_linear import act_quant

    counts = torch.tensor([5, 0, 2 * bm + 1, bm, 1], dtype=torch.int32)
    padded = (counts + bm - 1) // bm * bm
    ends = torch.cumsum(padded, 0).to(torch.int32)
    R = int(ends[-1]) + 2 * bm
    act = torch.randn(R, K, generator=torch.Generator().manual_seed(7)).to(BF16) * 3
    valid = torch.zeros(R, dtype=torch.bool)
    for e in range(len(counts)):
        start = int(ends[e] - padded[e])
        valid[start : start + int(counts[e])] = True
    act[~valid] = float("nan")
    q, s = moe_grouped.quant_valid_rows(act, ends, counts, bm, 8)
    q_all, s_all = act_quant(act)
    assert torch.equal(q[valid].view(torch.uint8), q_all[valid].view(torch.uint8))
    assert torch.equal(s[:, valid], s_all[:, valid])


def test_moe_grouped_takes_the_norms_e4m3_copy(monkeypatch):
    """The grouped FP8 experts given x's e4m3 copy (a norm's `act_buffers`, padded rows) compute what
    they compute from act_quant(x) themselves, bit for bit."""
    from metainfer.kernels import fp8_linear

    x, w_gu, w_dn, tw, ids = _problem(19, seed=9, skew=True, dtype=BF16)
    (q_gu, s_gu), (q_dn, s_dn) = quantize_fp8_block(w_gu), quantize_fp8_block(w_dn)
    gu, dn = moe._scale_args(s_gu, q_gu), moe._scale_args(s_dn, q_dn)
    cfg = moe_grouped.grouped_config(19, ids.shape[1], q_gu.shape[0], True)
    want = moe_grouped.grouped_rows(x, q_gu, q_dn, ids, gu, dn, True, cfg)
    xq = fp8_linear.act_buffers(19, x.shape[1], "cpu")
    q, s = fp8_linear.act_quant(x)
    xq[0][:19], xq[1][:, :19] = q, s
    assert torch.equal(moe_grouped.grouped_rows(x, q_gu, q_dn, ids, gu, dn, True, cfg, xq=xq), want)


# bf16 runs f32's interpreted program and w8a8 w8a8-skew's on a plainer layout: CI's slow pass
@pytest.mark.parametrize("kind", ["f32", pytest.param("bf16", marks=pytest.mark.slow),
                                  pytest.param("w8a8", marks=pytest.mark.slow), "w8a8-skew"])
def test_moe_grouped_swapped_operands(kind):
    """A config's SWAP=1 (the grouped GEMMs as weights @ rows^T: the weight tile the MMA's M side):
    within the dtype's tolerance of the reference and of the unswapped kernels (rel RMSE < 1e-5 fp32 /
    1e-2 bf16, e4m3 x e4m3 1e-3: the sums' order may differ)."""
    dtype = BF16 if kind == "bf16" else F32
    x, w_gu, w_dn, tw, ids = _problem(17, seed=5, skew=kind.endswith("skew"), dtype=dtype)
    args, ref_w = (x, w_gu, w_dn, tw, ids), (w_gu, w_dn)
    fp8 = kind.startswith("w8a8")
    if fp8:
        (q_gu, s_gu), (q_dn, s_dn) = quantize_fp8_block(w_gu), quantize_fp8_block(w_dn)
        args = (x, q_gu, q_dn, tw, ids, s_gu, s_dn)
        ref_w = (ref_dequant_fp8(q_gu, s_gu, dtype), ref_dequant_fp8(q_dn, s_dn, dtype))
    cfg = moe_grouped.grouped_config(17, K, E, fp8)
    runs = {swap: moe.moe_experts(*args, path="grouped", config=dict(cfg, SWAP=swap)) for swap in (0, 1)}
    want = ref.moe_experts(x, *ref_w, tw, ids)
    rmse, max_abs = TOL[dtype]
    tol = 8e-2 if fp8 else rmse  # e4m3 activations: as test_moe_grouped_w8a8
    assert rel_rmse(runs[1], want) < tol
    same = 1e-2 if dtype == BF16 else 1e-3 if fp8 else 1e-5
    assert rel_rmse(runs[1], runs[0]) < same, rel_rmse(runs[1], runs[0])
