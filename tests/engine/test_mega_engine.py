"""EngineConfig.megakernel on the CPU, where engine.mega_decode runs the program through its PyTorch
emulator (the CUDA kernel is judged against that emulator on the H200: tests/gpu/test_mega_gpu.py): an
engine with it generates what one without it does, greedy, for a two-layer cut of the full config with
FP8 dummy weights; each decode step's logits within 1e-2 relative RMSE of the plain engine's (the two
round FP8 products differently: tests/kernels/test_mega_emulate.py); a request decoding beside another
takes the usual path; the config refuses BF16 and speculation."""

from __future__ import annotations

import dataclasses
import json

import pytest

from metainfer.config import FULL, FULL_CONFIG, LINEAR, EngineConfig, ModelConfig
from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM
from tests.helpers import rel_rmse, token_prompts


@pytest.fixture(scope="module")
def cut_config(tmp_path_factory):
    full = ModelConfig.from_hf(FULL_CONFIG)
    cfg = dataclasses.replace(full, num_hidden_layers=2, layer_types=(LINEAR, FULL), num_experts=16,
                              vocab_size=512, mtp_num_hidden_layers=0)
    p = tmp_path_factory.mktemp("mega_cut") / "config.json"
    p.write_text(json.dumps(cfg.to_hf_text_dict()))
    return p


def _llm(cut_config, mega: bool) -> LLM:
    return LLM(model=f"dummy:{cut_config}", device="cpu", dtype="bfloat16", quantization="fp8",
               megakernel=mega, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64)


def test_megakernel_engine_generates_what_the_engine_does(cut_config):
    prompt = token_prompts([6], seed=4)[0]
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    runs = {}
    for mega in (False, True):
        llm = _llm(cut_config, mega)
        rows = []
        llm.engine.runner.logits_hook = lambda owners, logits, rows=rows: rows.append(logits.clone())
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
        runs[mega] = (out.token_ids, rows)
        if mega:
            assert llm.engine.runner.mega.steps == 4  # the prefill samples the first token; 4 decode steps
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 5
    assert len(runs[True][1]) == len(runs[False][1]) == 5
    for a, b in zip(runs[True][1][1:], runs[False][1][1:]):
        assert rel_rmse(a, b) < 1e-2, rel_rmse(a, b)


def test_two_sequences_take_the_usual_path(cut_config):
    llm = _llm(cut_config, True)
    prompts = token_prompts([5, 7], seed=6)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=3, temperature=0,
                                                                                  ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [3, 3]
    assert llm.engine.runner.mega.steps == 0  # both decode in every step


@pytest.mark.parametrize("kw", [dict(quantization=None), dict(quantization="fp8", speculative="ngram")])
def test_config_refuses(kw):
    with pytest.raises(ValueError, match="megakernel"):
        EngineConfig(model="", megakernel=True, **kw)
