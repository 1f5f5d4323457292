"""The oracle's layer check reads every layer's output through the model's layer hook; on the GPU a MoE
block's output is `ExpertRows` (its weighted sum left to the next norm), which the hook must still see
as the block's output tensor."""

from __future__ import annotations

import torch

from metainfer.model import qwen3_5_moe
from metainfer.model.layers import ExpertRows
from metainfer.oracle import layers as oracle_layers


def test_expert_rows_value_is_the_weighted_sum():
    g = torch.Generator().manual_seed(0)
    rows, w = torch.randn(5, 3, 7, generator=g), torch.rand(5, 3, generator=g)
    want = sum(rows[:, j] * w[:, j, None] for j in range(3))
    torch.testing.assert_close(ExpertRows(rows, w, torch.float32).value(), want, rtol=1e-6, atol=1e-6)
    assert ExpertRows(rows, w, torch.bfloat16).value().dtype == torch.bfloat16


def test_layer_hook_sees_expert_rows_as_their_sum(tiny, monkeypatch):
    """Every layer's output wrapped as ExpertRows of one slot (weight 1, or the output halved on two
    slots of weight 1): the streams the oracle reads are the plain run's."""
    llm = tiny.llm
    ids = list(range(3, 40))
    n = len(llm.engine.runner.model.layers) - 1
    plain, why = oracle_layers._engine_stream(llm, ids, n)
    assert plain is not None, why
    forward = qwen3_5_moe.DecoderLayer.forward

    def wrapped(self, *args, **kwargs):
        x, residual = forward(self, *args, **kwargs)
        if isinstance(x, torch.Tensor):
            half = (x.float() / 2)[:, None, :]
            x = ExpertRows(torch.cat([half, half], 1), torch.ones(x.shape[0], 2), x.dtype)
        return x, residual

    monkeypatch.setattr(qwen3_5_moe.DecoderLayer, "forward", wrapped)
    rows, why = oracle_layers._engine_stream(llm, ids, n)
    assert rows is not None, why
    for a, b in zip(plain, rows):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_engine_defaults_size_the_snapshot_pool_to_the_suite():
    """The engine's own default takes a share of free GPU memory for prefix-cache snapshots; the oracle
    sizes them to the suite so the reference fits beside the engine."""
    from metainfer.oracle.build import engine_defaults
    from metainfer.oracle.suites import build_suite

    suite = build_suite("quick", 4096)
    out = engine_defaults(suite, {}, 4096)
    assert out["num_snapshot_slots"] == out["max_num_seqs"] >= len(suite.prompts)
    assert engine_defaults(suite, {"num_snapshot_slots": 3}, 4096)["num_snapshot_slots"] == 3
