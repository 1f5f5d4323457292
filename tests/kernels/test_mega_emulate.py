"""The megakernel's program for a decode step (build_step.decode_program), executed by the PyTorch
emulator of its instructions (emulate.py), against the engine's own decode step on the CPU reference
path: a two-layer cut of the full config (one DeltaNet, one attention layer; 16 experts; the real
widths, which the kernel's rules need), FP8 dummy weights, a 6-token prefill, then one decode token.

The two paths round differently by design: the engine's CPU reference dequantises e4m3 weights to
bf16 before its bf16 matmuls, the emulator (the kernels' numerics) keeps dequantised weights exact with
fp32 sums. So the checks are tolerances, set at ~3x what was measured (2026-12-01, torch 2.13 CPU):
logits relative RMSE 3.1e-3 (< 1e-2) with the same top-5 tokens; conv state 1.4e-3, recurrent state
2.7e-3, this step's key 3.5e-3 and value 3.3e-3 (< 5e-3, 1e-2). A different token's step is 1.38 away
from the engine's: the check can fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from metainfer.config import FULL, FULL_CONFIG, LINEAR, ModelConfig
from metainfer.kernels.mega import build_step, emulate
from metainfer.kernels.mega import program as P
from metainfer.model.meta import CacheTensors, ForwardMeta
from tests.helpers import rel_rmse

BS = 16


@pytest.fixture(scope="module")
def setup():
    from metainfer.model.fp8 import quantize_model_fp8
    from metainfer.model.weights import build_model, init_dummy

    full = ModelConfig.from_hf(FULL_CONFIG)
    cfg = dataclasses.replace(full, num_hidden_layers=2, layer_types=(LINEAR, FULL), num_experts=16,
                              vocab_size=512, mtp_num_hidden_layers=0)
    torch.manual_seed(0)
    model = build_model(cfg, torch.bfloat16, "cpu")
    init_dummy(model, seed=3)
    quantize_model_fp8(model, lm_head=False)
    model.eval()
    kv = (4, BS, cfg.num_key_value_heads, cfg.head_dim)
    caches = CacheTensors(
        k=[torch.zeros(kv, dtype=torch.bfloat16)], v=[torch.zeros(kv, dtype=torch.bfloat16)],
        conv=[torch.zeros(3, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim, dtype=torch.bfloat16)],
        ssm=[torch.zeros(3, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)],
    )
    table = [2, 1]
    prompt = torch.tensor([5, 77, 301, 12, 9, 411])
    with torch.no_grad():  # the prefill, through the engine
        meta = ForwardMeta.build([6], [0], [table], [1], BS, [5], "cpu")
        model(prompt, torch.arange(6), meta, caches)
    return cfg, model, caches, table


def _clone(c: CacheTensors) -> CacheTensors:
    return CacheTensors(*[[t.clone() for t in ts] for ts in (c.k, c.v, c.conv, c.ssm)])


def test_program_step_matches_the_engine_step(setup):
    cfg, model, caches, table = setup
    token, pos = 123, 6
    eng, emu = _clone(caches), _clone(caches)
    with torch.no_grad():
        meta = ForwardMeta.build([1], [pos], [table], [1], BS, [0], "cpu")
        hidden = model(torch.tensor([token]), torch.tensor([pos]), meta, eng)
        want = model.compute_logits(hidden)[0]
    logits = torch.zeros(cfg.vocab_size)
    bt = torch.tensor(table + [0, 0], dtype=torch.int32)
    instrs = build_step.decode_program(model, emu, bt, logits)
    assert len(instrs) == 3 + 4 + 3 + 1 + 3  # DeltaNet 3, attention 4, two MoE blocks of 3, the head
    step = build_step.step_inputs(torch.zeros(P.STEP_WORDS, dtype=torch.int64), token, pos,
                                  kv_slot=table[pos // BS] * BS + pos % BS, state_slot=1, has_state=True,
                                  seq_len=pos + 1)
    vals = emulate.run(instrs, step)
    assert torch.equal(vals[-1], logits)
    err = rel_rmse(logits, want.float())
    assert err < 1e-2, err
    assert set(logits.topk(5).indices.tolist()) == set(want.float().topk(5).indices.tolist())
    # the side effects: conv and recurrent states of slot 1, this step's key and value
    assert rel_rmse(emu.conv[0][1].float(), eng.conv[0][1].float()) < 5e-3
    assert rel_rmse(emu.ssm[0][1], eng.ssm[0][1]) < 1e-2
    row = table[pos // BS], pos % BS
    assert rel_rmse(emu.k[0][row].float(), eng.k[0][row].float()) < 1e-2
    assert torch.equal(emu.k[0][2, :pos], eng.k[0][2, :pos])  # the prefill's keys are untouched
    assert rel_rmse(emu.v[0][row].float(), eng.v[0][row].float()) < 1e-2
    other = torch.zeros(cfg.vocab_size)  # the control: another token's step is far from the engine's
    step[P.STEP_TOKEN] = token + 1
    emulate.run(build_step.decode_program(model, _clone(caches), bt, other), step)
    assert rel_rmse(other, want.float()) > 0.5


def test_program_packs_every_instruction(setup):
    cfg, model, caches, table = setup
    logits = torch.zeros(cfg.vocab_size)
    instrs = build_step.decode_program(model, _clone(caches), torch.tensor(table, dtype=torch.int32), logits)
    prog = P.Program(instrs)
    assert prog.table.shape == (len(instrs), P.WORDS)
    ops = [int(w) & 0xFFFFFFFF for w in prog.table[:, 0]]
    moe = [P.OP_GEMV, P.OP_GATE_UP, P.OP_DOWN]
    deltanet = [P.OP_GEMV, P.OP_DELTA, P.OP_GEMV]
    attention = [P.OP_GEMV, P.OP_ATTEND, P.OP_COMBINE, P.OP_GEMV]
    assert ops == [*deltanet, *moe, *attention, *moe, P.OP_GEMV]
    assert [y.numel() for y in prog.y][:3] == [12352, 4096, 2048]


def test_route_picks_the_top_k_then_the_shared_expert():
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0, 0.1, 3.0], dtype=torch.bfloat16)  # 5 experts + the gate
    ids, w = emulate.route(logits, 2)
    assert ids == [1, 3, 5]  # the tie at 2.0: the lower index first
    assert torch.allclose(w[:2], torch.tensor([0.5, 0.5]))
    assert torch.allclose(w[2], torch.sigmoid(torch.tensor(3.0)))
