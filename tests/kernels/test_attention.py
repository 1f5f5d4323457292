"""paged_attention kernels vs the reference (TRITON_INTERPRET on CPU): split-KV decode (forced split
counts, empty splits), varlen causal prefill with cached prefixes, GQA groups, block sizes 4 and 16."""

from __future__ import annotations

import pytest
import torch

from metainfer.forward_meta import ForwardMeta
from metainfer.kernels import attention as attn
from metainfer.kernels import reference as ref
from tests.helpers import rel_rmse

KEEP_SPLIT_KV = {(torch.float32, 5, True), (torch.bfloat16, 2, False)}  # test_prefill_split_kv, by default

# (relative RMSE, max abs); bf16 is loose: the interpreter truncates fp32 -> bf16 casts
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 6e-2)}


def _setup(query_lens, context_lens, Hq, Hkv, D, bs, dtype, seed):
    """Random caches (every block, used or not), scattered block tables, random q."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    need = [-(-n // bs) for n in seq_lens]
    N = sum(need) + 3
    perm = (torch.randperm(N - 1, generator=g) + 1).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    meta = ForwardMeta.build(
        query_lens=query_lens, context_lens=context_lens, block_tables=tables,
        state_slots=list(range(len(query_lens))), block_size=bs, logits_rows=[], device="cpu",
        max_blocks=max(need) + 2,
    )
    k_cache = torch.randn(N, bs, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(N, bs, Hkv, D, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), Hq, D, generator=g).to(dtype)
    return q, k_cache, v_cache, meta


def _want(q, k_cache, v_cache, meta, scale):
    return ref.paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc_cpu, meta.seq_lens_cpu, scale
    )


def _close(got, want, dtype):
    rr, ma = TOL[dtype]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got.float()).all()
    assert rel_rmse(got, want) < rr, rel_rmse(got, want)
    assert (got.float() - want.float()).abs().max().item() < ma


@pytest.mark.parametrize(  # bs 16: 8 splits (empty ones) by default, 1 and 3 in the slow pass
    "bs,num_splits",
    [(4, 1), (4, 3), (4, 8), pytest.param(16, 1, marks=pytest.mark.slow),
     pytest.param(16, 3, marks=pytest.mark.slow), (16, 8)],
)
def test_decode_splits(bs, num_splits):
    """The reduce reads only the splits that held keys (seq_lens 1, 5, 17, 33 over 3 or 8 splits of 8-key
    steps leave some empty)."""
    ctx = [0, 4, 16, 32]  # seq_lens 1, 5, 17, 33
    q, kc, vc, meta = _setup([1] * 4, ctx, Hq=4, Hkv=2, D=32, bs=bs, dtype=torch.float32, seed=bs * 7)
    scale = 32**-0.5
    out = torch.empty_like(q)
    cfg = attn.DecodeConfig(block_n=8)
    attn._decode(q, kc, vc, meta, scale, out, cfg, num_splits=num_splits)
    _close(out, _want(q, kc, vc, meta, scale), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch(dtype):
    """Two decodes, then prefills: fresh (7 tokens), chunked over a cached prefix (3 after 14),
    and a one-token chunk after the decodes (handled by the prefill kernel)."""
    query_lens, ctx = [1, 1, 7, 3, 1], [4, 16, 0, 14, 9]
    q, kc, vc, meta = _setup(query_lens, ctx, Hq=4, Hkv=2, D=32, bs=4, dtype=dtype, seed=1)
    assert meta.num_decodes == 2
    scale = 32**-0.5
    _close(attn.paged_attention(q, kc, vc, meta, scale), _want(q, kc, vc, meta, scale), dtype)


def test_gqa_group_of_8_prefill_blocks():
    """G = 8 heads per KV head (as in the model); prefill rows span several query blocks."""
    query_lens, ctx = [1, 1, 5, 17], [32, 2, 0, 3]
    q, kc, vc, meta = _setup(query_lens, ctx, Hq=8, Hkv=1, D=16, bs=16, dtype=torch.float32, seed=2)
    scale = 0.3
    out = torch.empty_like(q)
    attn._decode(q, kc, vc, meta, scale, out, attn.DecodeConfig(block_n=16), num_splits=2)
    attn._prefill(q, kc, vc, meta, scale, out, attn.PrefillConfig(block_rows=32, block_n=16))
    _close(out, _want(q, kc, vc, meta, scale), torch.float32)


def test_prefill_only_and_empty():
    q, kc, vc, meta = _setup([6, 2], [0, 5], Hq=2, Hkv=2, D=32, bs=4, dtype=torch.float32, seed=3)
    assert meta.num_decodes == 0
    _close(attn.paged_attention(q, kc, vc, meta, 0.2), _want(q, kc, vc, meta, 0.2), torch.float32)
    empty = attn.paged_attention(q[:0], kc, vc, meta, 0.2)
    assert empty.shape == (0, 2, 32)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_gate(dtype, num_splits):
    """o * sigmoid(gate) applied as the result is stored: by the split kernel (one split), the
    reduce kernel (several) and the prefill kernel; gate is a strided view, as the model's."""
    query_lens, ctx = [1, 1, 7, 3], [4, 16, 0, 14]
    q, kc, vc, meta = _setup(query_lens, ctx, Hq=4, Hkv=2, D=32, bs=4, dtype=dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    gate = (torch.randn(q.shape[0], 4, 64, generator=g) * 2).to(dtype)[..., 32:]
    scale = 32**-0.5
    want = _want(q, kc, vc, meta, scale) * torch.sigmoid(gate)
    out = torch.empty_like(q)
    attn._decode(q, kc, vc, meta, scale, out, attn.DecodeConfig(block_n=8), num_splits=num_splits, gate=gate)
    attn._prefill(q, kc, vc, meta, scale, out, attn.PrefillConfig(block_rows=16, block_n=8), gate=gate)
    _close(out, want, dtype)
    _close(attn.paged_attention(q, kc, vc, meta, scale, gate=gate), want, dtype)


# chunk 4 (slow pass only) takes chunk 2's branch: fewer than the active splits
@pytest.mark.parametrize("chunk", [2, pytest.param(4, marks=pytest.mark.slow), 16])
def test_decode_reduce_active_splits_equal_no_split(chunk, monkeypatch):
    """The active-split reduce (running max over chunks) against the unsplit kernel, with splits beyond the
    active ones filled with garbage (NaN) that it may not read, a padding row of length 0 (zeros), and
    chunks smaller than the active count (the running max rescales)."""
    ctx = [40, 0, 7, 63, 0]  # seq_lens 41, 1, 8, 64; the last row is padding (length 0)
    q, kc, vc, meta = _setup([1] * 5, ctx, Hq=4, Hkv=2, D=32, bs=8, dtype=torch.float32, seed=5)
    meta.seq_lens[4] = 0
    cfg = attn.DecodeConfig(block_n=8, reduce_chunk=chunk)
    want = torch.full_like(q, 7.0)
    attn._decode(q, kc, vc, meta, 32**-0.5, want, cfg, num_splits=1)
    real_empty = torch.empty
    with monkeypatch.context() as mp:  # part_o / part_lse start as garbage
        mp.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
        out = torch.full_like(q, 7.0)
        attn._decode(q, kc, vc, meta, 32**-0.5, out, cfg, num_splits=8)
    assert torch.isfinite(out).all() and (out[4] == 0).all()
    assert rel_rmse(out[:4], want[:4]) < 1e-6, rel_rmse(out[:4], want[:4])


def test_num_splits_from_host_ints():
    cfg = attn.DecodeConfig()
    assert attn.decode_num_splits(1, 2, 8192, cfg) == min(cfg.max_splits, 8192 // cfg.min_split_tokens)
    assert attn.decode_num_splits(256, 2, 8192, cfg) == 1
    assert attn.decode_num_splits(1, 2, 16, cfg) == 1


def test_registered():
    from metainfer.kernels import registry

    assert registry.load({"paged_attention"}) == {"paged_attention": attn.paged_attention}


# each dtype, split count and gating once in the default suite (fp32: 5 splits, gated; bf16: 2, ungated);
# the other combinations run the same interpreted programs, in CI's slow pass
@pytest.mark.parametrize(
    "dtype,num_splits,gated",
    [pytest.param(dt, ns, gated, marks=() if (dt, ns, gated) in KEEP_SPLIT_KV else pytest.mark.slow)
     for dt in (torch.float32, torch.bfloat16) for ns in (2, 5) for gated in (False, True)],
)
def test_prefill_split_kv(dtype, num_splits, gated):
    """The prefill kernel's KV splits merged by the decode reduce kernel (prefill rows after two
    decodes, so the reduce works on a view from row s0): short chunks over cached prefixes (5 after
    37, 1 after 20, 3 after 0, a fresh 9), more splits than some chunks have key blocks (empty
    splits), GQA 4:2, with and without the output gate; equal to the unsplit kernel within
    rounding and to the reference."""
    query_lens, ctx = [1, 1, 5, 1, 3, 9], [4, 16, 37, 20, 0, 0]
    q, kc, vc, meta = _setup(query_lens, ctx, Hq=4, Hkv=2, D=32, bs=4, dtype=dtype, seed=9)
    assert meta.num_decodes == 2
    scale = 32**-0.5
    gate = None
    want = _want(q, kc, vc, meta, scale)
    if gated:
        g = torch.Generator().manual_seed(10)
        gate = (torch.randn(q.shape[0], 4, 64, generator=g) * 2).to(dtype)[..., 32:]
        want = want * torch.sigmoid(gate)
    cfg = attn.PrefillConfig(block_rows=16, block_n=8)
    outs = []
    for ns in (1, num_splits):
        out = torch.full_like(q, 5.0)
        attn._prefill(q, kc, vc, meta, scale, out, cfg, gate=gate, num_splits=ns)
        assert torch.equal(out[:2], torch.full_like(out[:2], 5.0))  # the decode rows untouched
        outs.append(out[2:])
        _close(out[2:], want[2:], dtype)
    assert rel_rmse(outs[1], outs[0]) < TOL[dtype][0]


def test_prefill_num_splits_only_when_short():
    assert attn.prefill_num_splits(5, 2, 8192) == attn.decode_num_splits(1, 2, 8192, attn.DECODE) > 1
    assert attn.prefill_num_splits(attn.PREFILL_SPLIT_MAX_Q + 1, 2, 8192) == 1
    assert attn.prefill_num_splits(5, 2, 16) == 1  # a context too short to split
