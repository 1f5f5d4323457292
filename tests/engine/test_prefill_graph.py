"""Lone-prefill CUDA graphs' padded layout (metainfer.engine.prefill_graph), run eagerly on the CPU
reference ops: a request's chunk followed by a padding sequence on the null slot and block gives
the logits of the plain step, and an engine with the graphs configured generates what one without
them does (greedy, seeded sampling, chunked prompts, one request at a time and several). The graph
capture itself is tested on the H200 (tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import pytest

from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM
from tests.helpers import rel_rmse, save_hf_model, token_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefill_graph_hf")
    save_hf_model(d, seed=5)
    return d


def _llm(model_dir, **kw):
    return LLM(model=str(model_dir), device="cpu", dtype="float32", **kw)


def test_padded_step_logits_equal_the_plain_step(model_dir):
    """Each prompt alone: the first token's logits through the padded layout (sizes 8, 16, 64)
    against the plain eager step, by rel. RMSE < 1e-5 (fp32; other batch shapes only)."""
    seen = {}
    for sizes in ((), (8, 16, 64)):
        llm = _llm(model_dir, prefill_graphs=sizes, max_num_batched_tokens=64)
        assert (llm.engine.runner.prefill is not None) == bool(sizes)
        rows = []
        llm.engine.runner.logits_hook = lambda owners, logits, rows=rows: rows.append(logits.clone())
        for p in token_prompts([2, 7, 8, 15, 40]):  # 8: no padding
            llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=1, temperature=0))
        seen[sizes] = rows
        if sizes:
            assert llm.engine.runner.prefill.runs == 5
    assert len(seen[()]) == len(seen[(8, 16, 64)]) == 5
    for a, b in zip(seen[()], seen[(8, 16, 64)]):
        assert a.shape == b.shape == (1, a.shape[1]) and rel_rmse(b, a) < 1e-5


def test_engine_outputs_equal_with_prefill_graphs(model_dir):
    """Greedy and seeded requests, prompts longer than the largest size (chunked: only the last
    chunk, if it fits, takes the graph layout), all at once and one by one; caches freed."""
    prompts = token_prompts([3, 16, 30, 70, 5], seed=2)
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.7, top_k=30, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    ]
    outs = {}
    for sizes in ((), (16, 32)):
        llm = _llm(model_dir, prefill_graphs=sizes, max_num_batched_tokens=48, max_num_seqs=4)
        together = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        alone = [llm.generate(prompt_token_ids=[p], sampling_params=sp)[0] for p, sp in zip(prompts, params)]
        usage = llm.engine.cache.usage()
        assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0
        outs[sizes] = [o.token_ids for o in together + alone]
        if sizes:  # the lone prompts of 3, 16, 30 tokens and the last chunks that fit
            assert llm.engine.runner.prefill.runs >= 3
    assert outs[()] == outs[(16, 32)]


def test_prefill_graph_sizes_validated():
    with pytest.raises(ValueError, match="prefill_graphs"):
        _llm("", prefill_graphs=(1,))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        _llm("", prefill_graphs=(64, 8192), max_num_batched_tokens=4096)
    with pytest.raises(ValueError, match="max_model_len"):
        _llm("", prefill_graphs=(64, 1024), max_model_len=512)


def test_prefill_graph_default_sizes():
    """Unset: the default sizes up to the step budget (on CUDA; the CPU runner takes none); (): none."""
    from metainfer.config import DEFAULT_PREFILL_GRAPHS, EngineConfig

    assert EngineConfig().prefill_graph_sizes == DEFAULT_PREFILL_GRAPHS
    assert EngineConfig(max_num_batched_tokens=600).prefill_graph_sizes == (128, 256, 512)
    assert EngineConfig(max_model_len=512).prefill_graph_sizes == (128, 256, 512)  # one block-table row
    assert EngineConfig(prefill_graphs=()).prefill_graph_sizes == ()
    assert _llm("").engine.runner.prefill is None  # CPU default


def test_staged_inputs_layout():
    """`PrefillGraphs._fill` writes the step's device buffers from two staged copies: a long chunk
    then a short one (stale host and device entries past the short one's tokens and blocks are
    never read) leaves exactly the layout the module docstring describes."""
    import torch

    from metainfer.engine.prefill_graph import PrefillGraphs

    pg = PrefillGraphs(None, None, [5, 16], 8, 4, torch.device("cpu"), use_graphs=False, logits_rows=3)
    pg._fill(16, list(range(100, 116)), 4, [7, 3, 9, 2, 6], 2, rows=3)
    toks, start, blocks, slot = [11, 12, 13, 14], 6, [5, 1, 8], 3  # positions 6..9: blocks 1 and 8
    pg._fill(5, toks, start, blocks, slot, rows=2)
    assert pg.input_ids[:5].tolist() == toks + [0]
    assert pg.positions[:5].tolist() == [6, 7, 8, 9, 0]  # the padding sequence starts at 0
    assert pg.slot_mapping[:5].tolist() == [1 * 4 + 2, 1 * 4 + 3, 8 * 4 + 0, 8 * 4 + 1, 0]  # pad: block 0
    assert pg.query_start_loc.tolist() == [0, 4, 5]
    assert pg.seq_lens.tolist() == [10, 1] and pg.context_lens.tolist() == [6, 0]
    assert pg.block_tables[0, :3].tolist() == blocks and pg.block_tables[1].tolist() == [0] * 8
    assert pg.state_slots.tolist() == [3, 0]
    assert pg.logits_indices.tolist() == [2, 3, 3]  # the last 2 rows, the last repeated
