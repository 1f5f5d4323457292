"""--ssm-state-dtype bfloat16: the DeltaNet recurrent states stored in bf16 (fp32 math), on the CPU
reference path; the GPU kernels' side is tests/kernels/test_gdn_{decode,prefill}.py."""

from __future__ import annotations

import pytest
import torch

from metainfer.config import EngineConfig
from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM
from tests.helpers import rel_rmse, token_prompts, write_config


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("ssm"))


def _llm(cfg, state_dtype: str, **kw) -> LLM:
    return LLM(model=f"dummy:{cfg}", device="cpu", dtype="float32", ssm_state_dtype=state_dtype,
               max_num_batched_tokens=24, **kw)


def test_bf16_states_stay_close_to_fp32(cfg):
    """Chunked prompts (state carried between chunks and into the decodes) and greedy decodes: the
    caches hold bf16 states, half the bytes per slot, and the logits stay within bf16 rounding of
    the fp32-state engine's (rel. RMSE < 2e-2 over every scored and decoded row)."""
    prompts = token_prompts([40, 7, 31], seed=3)
    ref, b16 = _llm(cfg, "float32"), _llm(cfg, "bfloat16")
    assert all(h.dtype == torch.float32 for h in ref.engine.runner.caches.ssm)
    assert all(h.dtype == torch.bfloat16 for h in b16.engine.runner.caches.ssm)
    per_slot = ref.engine.runner._bytes_per_slot() - b16.engine.runner._bytes_per_slot()
    c = ref.engine.runner.cfg
    assert per_slot == len(c.linear_layer_ids) * c.linear_num_value_heads * c.linear_key_head_dim * \
        c.linear_value_head_dim * 2
    for a, b in zip(ref.score(prompts), b16.score(prompts)):
        assert a.shape == b.shape and rel_rmse(b, a) < 2e-2
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = b16.generate(prompt_token_ids=prompts, sampling_params=sp)
    assert all(len(o.token_ids) == 12 for o in outs)
    usage = b16.engine.cache.usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0


def test_ssm_state_dtype_is_validated():
    with pytest.raises(ValueError, match="ssm_state_dtype"):
        EngineConfig(ssm_state_dtype="float16")
