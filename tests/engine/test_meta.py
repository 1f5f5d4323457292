"""ForwardMeta: the step layout built from host lists."""

from __future__ import annotations

import torch

from metainfer.forward_meta import ForwardMeta


def _meta(query_lens, context_lens):
    n = len(query_lens)
    return ForwardMeta.build(
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=[[i + 1, i + 5] for i in range(n)],
        state_slots=list(range(1, n + 1)),
        block_size=4,
        logits_rows=[],
        device="cpu",
    )


def test_prefill_offsets_after_decodes():
    m = _meta([1, 1, 5, 3], [7, 2, 0, 4])
    assert m.num_decodes == 2 and m.query_start_loc_cpu == [0, 1, 2, 7, 10]
    cu = m.prefill_offsets()
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 8]
    assert m.prefill_offsets() is cu  # once per step, not per layer
    assert m.has_state.tolist() == [True, True, False, True]


def test_prefill_offsets_pure_prefill_is_a_view():
    m = _meta([4, 2], [0, 3])
    cu = m.prefill_offsets()
    assert cu.tolist() == [0, 4, 6] and cu.data_ptr() == m.query_start_loc.data_ptr()
