"""The batched reference (`reference_logits_batch`): right-padded sequences in one forward give each
sequence's own logits, in every compute mode, on a model with full attention, DeltaNet layers and
MoE. Tolerance: float32 round-off of the wider matmuls (1e-5 relative); a pad leaking into a real
position (a non-causal layer) moves the logits by orders of magnitude more."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from metainfer.oracle.reference import Reference
    from tests.helpers import write_config

    cfg = write_config(tmp_path_factory.mktemp("refbatch"), num_hidden_layers=4, vocab_size=512)
    return Reference.from_recipe(cfg, seed=3, device="cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("mode", ["exact", "fp8", "native"])
def test_batch_equals_one_at_a_time(reference, mode):
    from metainfer.oracle.precision import reference_logits, reference_logits_batch

    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 7, 33, 70)]
    got = reference_logits_batch(reference, seqs, mode)
    for s, g in zip(seqs, got):
        want = reference_logits(reference, s, mode)
        assert g.shape == want.shape == (len(s), 512)
        tol = 1e-5 if mode != "native" else 2e-2  # native: BF16 round-off of other matmul shapes
        rel = float((g - want).norm() / want.norm())
        assert rel <= tol, (mode, len(s), rel)


def test_a_leaking_pad_would_be_seen(reference):
    """The test's own power: a sequence whose tail differs changes its earlier rows by nothing, a
    sequence whose head differs changes its later rows by far more than the tolerance."""
    from metainfer.oracle.precision import reference_logits

    a = list(range(10, 40))
    b = a[:15] + [500 - x for x in a[15:]]
    la, lb = reference_logits(reference, a, "exact"), reference_logits(reference, b, "exact")
    assert torch.equal(la[:15], lb[:15])
    c = [1] + a[1:]
    lc = reference_logits(reference, c, "exact")
    assert float((lc[20:] - la[20:]).norm() / la[20:].norm()) > 1e-3


@pytest.mark.parametrize("mode", ["exact", "fp8"])
def test_chunked_attention_equals_whole(reference, monkeypatch, mode):
    """A prompt longer than SDPA_CHUNK: attention computed in query chunks gives the logits of one
    whole-matrix call (float32 round-off)."""
    from metainfer.oracle import precision

    ids = torch.randint(0, 512, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = precision.reference_logits(reference, ids, mode)
    calls = []
    real = precision._chunked_sdpa
    monkeypatch.setattr(precision, "SDPA_CHUNK", 16)
    monkeypatch.setattr(precision, "_chunked_sdpa", lambda *a, **k: calls.append(1) or real(*a, **k))
    chunked = precision.reference_logits(reference, ids, mode)
    assert calls, "the attention layer never reached the chunked path"
    rel = float((chunked - whole).norm() / whole.norm())
    assert rel <= 1e-5, rel
    assert not torch.equal(chunked[:20], torch.zeros_like(chunked[:20]))
