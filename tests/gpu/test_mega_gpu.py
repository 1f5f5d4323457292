"""The megakernel on the H200 (skipped without an sm_90 GPU and nvcc). Every instruction's outputs are
checked against emulate.py run from the kernel's own outputs of the instructions before it (so each
instruction is judged alone), then whole steps against the engine:

- a chain of GEMVs (e4m3 with block scales and bf16 weights; k of 512, 2048, 4096; the RMSNorm and
  add + RMSNorm prologues; fp32, bf16 and plain outputs; sliced sources; more rows than chunks per CTA);
- an MoE block (router, GateUp, Down) with 16 experts, top 8 and the shared expert;
- the decode step of a two-layer cut of the full config (one DeltaNet, one attention layer; FP8 dummy
  weights) after a 6-token prefill: per instruction, the states and cache after the step, and the
  logits against the engine's own decode step on its Triton kernels;
- a second launch gives the same bits under the next tag; a CUDA graph of a launch replays.

The kernel checks run with the CUDA-core and the tensor-core consumers (launch mma=False / True), on the
default build or the one of METAINFER_MEGA_DEFINES (-D flags, space-separated: a variant under test).

Tolerances (relative RMSE): outputs rounded to bf16 5e-3 (a rounding may flip against float64's); fp32
outputs 1e-4, 1e-3 through a norm prologue; attention partials 5e-3 (bf16 probabilities); the step's
logits against the engine's 1e-2 (the CPU emulator measured 3.1e-3 against the reference path)."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil

import pytest
import torch

from tests.helpers import rel_rmse

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0)
                       or shutil.which("nvcc") is None, reason="needs an sm_90 GPU and nvcc"),
]
BS = 16
DEV = "cuda"  # (a CPU dry run of this module's helpers swaps it, with the emulator as the kernel)


def _e4m3(*shape, g):
    w = (torch.randn(*shape, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn)
    blocks = (*shape[:-2], (shape[-2] + 127) // 128, shape[-1] // 128)
    ws = 0.5 + 1.5 * torch.rand(*blocks, device=DEV, generator=g)
    return w, ws / 64


def _bf16(*shape, g, scale=1.0):
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(torch.bfloat16)


@pytest.fixture(scope="module")
def kernel():
    from metainfer.kernels.mega.launch import MegaKernel

    return MegaKernel(DEV, defines=tuple(os.environ.get("METAINFER_MEGA_DEFINES", "").split()))


def _gemv_chain(seed=0):
    from metainfer.kernels.mega import program as P

    g = torch.Generator(device=DEV).manual_seed(seed)
    w0, s0 = _e4m3(4200, 2048, g=g)
    w1, s1 = _e4m3(2048, 512, g=g)
    w2, s2 = _e4m3(1000, 4096, g=g)
    w5, s5 = _e4m3(20001, 2048, g=g)
    logits = torch.zeros(20001, device=DEV)
    return [
        P.Gemv(w0, P.Vec(_bf16(2048, g=g, scale=3.0)), ws=s0, norm_w=_bf16(2048, g=g, scale=0.1)),
        P.Gemv(w1, P.Src(0, 100), ws=s1),
        P.Gemv(w2, P.Src(0), ws=s2, out=P.OUT_F32),
        P.Gemv(_bf16(257, 2048, g=g, scale=0.05), P.Src(0), norm_w=_bf16(2048, g=g, scale=0.1)),
        P.Gemv(_bf16(2048, 2048, g=g, scale=0.05), P.Src(1), norm_w=_bf16(2048, g=g, scale=0.1),
               add=P.Src(0, 6)),  # (staged sources are read in pairs of words: offsets even)
        P.Gemv(w5, P.Src(4), ws=s5, norm_w=_bf16(2048, g=g, scale=0.1), eps=1e-5, out=P.OUT_PLAIN_F32,
               plain_out=logits),
    ]


def _moe_block(seed=0, E=16, top_k=8):
    from metainfer.kernels.mega import program as P

    g = torch.Generator(device=DEV).manual_seed(seed)
    h = P.Vec(_bf16(2048, g=g))
    wm, sm = _e4m3(2048, 512, g=g)
    wgu, sgu = _e4m3(E + 1, 1024, 2048, g=g)
    wdn, sdn = _e4m3(E + 1, 2048, 512, g=g)
    nw = _bf16(2048, g=g, scale=0.1)
    return [
        P.Gemv(wm, P.Vec(_bf16(512, g=g)), ws=sm),  # the mixer's output
        P.Gemv(_bf16(E + 1, 2048, g=g, scale=0.05), h, norm_w=nw, add=P.Src(0)),  # the router
        P.GateUp(wgu, sgu, h, P.Src(0), nw, P.Src(1), top_k),
        P.Down(wdn, sdn, P.Src(2), P.Src(1), h, P.Src(0), top_k),
    ]


TOL_BF16, TOL_F32, TOL_F32_NORM, TOL_ATTEND = 5e-3, 1e-4, 1e-3, 5e-3


def _check_each(prog, instrs_emu, step):
    """Every instruction of the kernel's program against emulate.one from the kernel's earlier outputs."""
    from metainfer.kernels.mega import emulate
    from metainfer.kernels.mega import program as P

    assert prog.error() is None, prog.error()
    vals = [prog.values(i) for i in range(len(prog.instrs))]
    for i, g in enumerate(instrs_emu):
        want = emulate.one(g, vals[:i], step.cpu()).float()
        got = vals[i].float()
        assert bool((prog.tags(i) == prog.step()).all()), (i, "untagged outputs")
        if isinstance(g, P.Attend):
            fin = torch.isfinite(want)
            assert torch.equal(fin, torch.isfinite(got)), i
            got, want = got[fin], want[fin]
            tol = TOL_ATTEND
        elif P.out_dtype(g) == P.OUT_BF16:
            tol = TOL_BF16
        else:
            tol = TOL_F32_NORM if g.norm_w is not None else TOL_F32
        assert torch.isfinite(got).all(), i
        assert rel_rmse(got, want) < tol, (i, type(g).__name__, rel_rmse(got, want))
    return vals


def _bits(prog):
    return [y.view(torch.int32).view(-1, 2)[:, 0].clone() for y in prog.y]


def _launched(kernel, instrs, mma):
    """The program of instrs after one launch (synchronised)."""
    from metainfer.kernels.mega import program as P

    prog = P.Program(instrs)
    kernel.launch(prog, mma=mma)
    torch.cuda.synchronize()
    return prog


@pytest.mark.parametrize("mma", [False, True])
def test_gemv_chain(kernel, mma):
    instrs = _gemv_chain()
    prog = _launched(kernel, instrs, mma)
    assert prog.step() == 1
    assert torch.equal(instrs[-1].plain_out, prog.values(5))  # (before the emulator overwrites it)
    _check_each(prog, instrs, prog.step_inputs)


@pytest.mark.parametrize("mma", [False, True])
def test_moe_block(kernel, mma):
    from metainfer.kernels.mega import emulate

    instrs = _moe_block()
    prog = _launched(kernel, instrs, mma)
    vals = _check_each(prog, instrs, prog.step_inputs)
    ids, _ = emulate.route(vals[1], 8)
    assert len(set(ids)) == 9 and ids[-1] == 16


def test_second_launch_same_bits_next_tag(kernel):
    from metainfer.kernels.mega import program as P

    prog = P.Program(_moe_block(seed=1) + _gemv_chain(seed=1)[:2])
    kernel.launch(prog)
    first = _bits(prog)
    kernel.launch(prog)
    torch.cuda.synchronize()
    assert prog.error() is None, prog.error()
    assert prog.step() == 2
    for i, (a, b) in enumerate(zip(_bits(prog), first)):
        assert bool((prog.tags(i) == 2).all()) and torch.equal(a, b), i


def test_cuda_graph_replay(kernel):
    from metainfer.kernels.mega import program as P

    prog = P.Program(_gemv_chain(seed=2))
    kernel.launch(prog)
    torch.cuda.synchronize()
    eager = _bits(prog)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        kernel.launch(prog)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert prog.error() is None, prog.error()
    assert prog.step() == 4  # eager 1, then 3 replays (capturing runs nothing)
    for i, (a, b) in enumerate(zip(_bits(prog), eager)):
        assert bool((prog.tags(i) == 4).all()) and torch.equal(a, b), i


@pytest.fixture(scope="module")
def cut_model():
    from metainfer.config import FULL, FULL_CONFIG, LINEAR, ModelConfig
    from metainfer.kernels import ops
    from metainfer.model.fp8 import quantize_model_fp8
    from metainfer.model.meta import CacheTensors, ForwardMeta
    from metainfer.model.weights import build_model, init_dummy

    ops.use_kernels(True)
    full = ModelConfig.from_hf(FULL_CONFIG)
    cfg = dataclasses.replace(full, num_hidden_layers=2, layer_types=(LINEAR, FULL), num_experts=16,
                              vocab_size=4096, mtp_num_hidden_layers=0)
    model = build_model(cfg, torch.bfloat16, DEV)
    init_dummy(model, seed=3)
    quantize_model_fp8(model, lm_head=False)
    kv = (4, BS, cfg.num_key_value_heads, cfg.head_dim)
    caches = CacheTensors(
        k=[torch.zeros(kv, dtype=torch.bfloat16, device=DEV)],
        v=[torch.zeros(kv, dtype=torch.bfloat16, device=DEV)],
        conv=[torch.zeros(3, 3, cfg.linear_conv_dim, dtype=torch.bfloat16, device=DEV)],
        ssm=[torch.zeros(3, cfg.linear_num_value_heads, 128, 128, device=DEV)],
    )
    table = [2, 1]
    with torch.no_grad():
        meta = ForwardMeta.build([6], [0], [table], [1], BS, [5], DEV)
        prompt = torch.tensor([5, 77, 301, 12, 9, 411], device=DEV)
        model(prompt, torch.arange(6, device=DEV), meta, caches)
    torch.cuda.synchronize()
    return cfg, model, caches, table


def _clone(c):
    from metainfer.model.meta import CacheTensors

    return CacheTensors(*[[t.clone() for t in ts] for ts in (c.k, c.v, c.conv, c.ssm)])


@pytest.mark.parametrize("mma", [False, True])
def test_decode_step(kernel, cut_model, mma):
    from metainfer.kernels.mega import build_step
    from metainfer.kernels.mega import program as P
    from metainfer.model.meta import ForwardMeta

    cfg, model, caches, table = cut_model
    token, pos = 123, 6
    ker, emu, eng = _clone(caches), _clone(caches), _clone(caches)
    bt = torch.tensor(table + [0, 0], dtype=torch.int32, device=DEV)
    logits = torch.zeros(cfg.vocab_size, device=DEV)
    step = build_step.step_inputs(torch.zeros(P.STEP_WORDS, dtype=torch.int64, device=DEV), token, pos,
                                  kv_slot=table[pos // BS] * BS + pos % BS, state_slot=1, has_state=True,
                                  seq_len=pos + 1)
    prog = P.Program(build_step.decode_program(model, ker, bt, logits), step=step)
    kernel.launch(prog, mma=mma, lead=131072 if mma else 0)  # (the L2 lead moves no value)
    torch.cuda.synchronize()
    emu_logits = torch.zeros(cfg.vocab_size, device=DEV)
    _check_each(prog, build_step.decode_program(model, emu, bt, emu_logits), step)
    assert rel_rmse(ker.conv[0][1].float(), emu.conv[0][1].float()) < TOL_BF16
    assert rel_rmse(ker.ssm[0][1], emu.ssm[0][1]) < TOL_F32_NORM
    row = table[pos // BS], pos % BS
    assert rel_rmse(ker.k[0][row].float(), emu.k[0][row].float()) < TOL_BF16
    assert torch.equal(ker.v[0][row], emu.v[0][row])
    with torch.no_grad():  # the engine's own step (its Triton kernels)
        meta = ForwardMeta.build([1], [pos], [table], [1], BS, [0], DEV)
        hidden = model(torch.tensor([token], device=DEV), torch.tensor([pos], device=DEV), meta, eng)
        want = model.compute_logits(hidden)[0].float()
    assert math.isfinite(float(logits.sum()))
    assert rel_rmse(logits, want) < 1e-2, rel_rmse(logits, want)
    assert int(logits.argmax()) == int(want.argmax())
