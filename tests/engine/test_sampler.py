"""Device sampling: filters, seeds, distribution."""

from __future__ import annotations

import torch

from metainfer.engine.sampler import LogitBias, SamplingBatch, add_logit_bias, sample, uniform_noise


def sb(rows):
    return SamplingBatch.build(rows, "cpu")


def test_greedy_is_argmax():
    logits = torch.randn(5, 97)
    out = sample(logits, sb([(0.0, 0, 1.0, 0.0, i, 0) for i in range(5)]))
    assert torch.equal(out, logits.argmax(-1))


def test_noise_in_open_interval_and_seeded():
    u = uniform_noise(torch.tensor([1, 2, -5]), torch.tensor([0, 0, 7]), 1000)
    assert u.min() > 0 and u.max() < 1
    u2 = uniform_noise(torch.tensor([1, 2, -5]), torch.tensor([0, 0, 7]), 1000)
    assert torch.equal(u, u2)
    assert not torch.equal(u[0], u[1])
    assert abs(float(u.mean()) - 0.5) < 0.03


def test_same_seed_same_tokens_independent_of_batch():
    logits = torch.randn(3, 50)
    rows = [(1.0, 0, 1.0, 0.0, 42, 3), (0.7, 5, 0.9, 0.0, 7, 0), (1.3, 0, 1.0, 0.1, 42, 3)]
    full = sample(logits, sb(rows))
    alone = sample(logits[1:2], sb(rows[1:2]))
    assert full[1] == alone[0]
    assert torch.equal(full, sample(logits, sb(rows)))


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(400, 1)
    rows_k = [(2.0, 2, 1.0, 0.0, s, 0) for s in range(400)]
    assert set(sample(logits, sb(rows_k)).tolist()) == {0, 1}
    p = logits[0].softmax(-1)  # top_p just above p0 + p1 keeps three tokens
    rows_p = [(1.0, 0, float(p[0] + p[1]) + 1e-3, 0.0, s, 0) for s in range(400)]
    assert set(sample(logits, sb(rows_p)).tolist()) == {0, 1, 2}
    rows_m = [(1.0, 0, 1.0, float(p[2] / p[0]) - 1e-4, s, 0) for s in range(400)]
    assert set(sample(logits, sb(rows_m)).tolist()) == {0, 1, 2}


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(6000, 1)
    toks = sample(logits, sb([(1.0, 0, 1.0, 0.0, 1234, s) for s in range(6000)]))
    freq = torch.bincount(toks, minlength=3).float() / 6000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03), freq


def test_logit_bias_is_a_sparse_per_row_add():
    logits = torch.randn(4, 50)
    biases = [LogitBias.of([(3, 100.0), (7, -2.5)]), LogitBias.of([(0, -100.0)])]
    want = logits.clone()
    want[1, 3] += 100.0
    want[1, 7] -= 2.5
    want[3, 0] -= 100.0
    got = logits.clone()
    add_logit_bias(got, [1, 3], biases)
    assert torch.equal(got, want)
    bf16 = logits.bfloat16()
    add_logit_bias(bf16, [1, 3], biases)
    assert bf16.dtype == torch.bfloat16 and int(bf16[1].argmax()) == 3
    out = sample(got, sb([(0.0, 0, 1.0, 0.0, 0, 0)] * 2 + [(1.0, 0, 1.0, 0.0, 5, 0)] * 2))
    assert int(out[1]) == 3 and int(out[3]) != 0
