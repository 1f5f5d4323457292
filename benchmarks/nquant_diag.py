"""KB-0052 diagnosis on the GPU: the FP8 engine with METAINFER_NORM_QUANT=1 on the GPU engine test's
prompts, every e4m3 copy a consumer takes checked against act_quant of the rows it multiplies (the
cuBLAS W8A8 GEMMs, the grouped experts); then each norm's stored output with the copy and without.
Prints the consumers whose copy differs (shape, bytes and scales that differ)."""

from __future__ import annotations

import os
from collections import Counter

import torch

os.environ["METAINFER_NORM_QUANT"] = "1"

from metainfer.engine.request import SamplingParams  # noqa: E402
from metainfer.kernels import fp8_linear, moe_grouped, ops  # noqa: E402
from metainfer.llm import LLM  # noqa: E402

calls, bad = Counter(), []


def diff(where, x, xq):
    T = x.shape[0]
    pad = fp8_linear.act_rows(T) - T
    q, s = fp8_linear.act_quant(torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x)
    qd = (xq[0][:T].view(torch.uint8) != q[:T].view(torch.uint8)).sum().item()
    sd = (xq[1][:, :T] != s[:, :T]).sum().item()
    calls[where, tuple(x.shape)] += 1
    if qd or sd:
        rows = (xq[0][:T].view(torch.uint8) != q[:T].view(torch.uint8)).any(1).nonzero().flatten().tolist()
        bad.append((where, tuple(x.shape), x.stride(), qd, sd, rows[:8]))


w8a8, grouped = fp8_linear._w8a8, moe_grouped.grouped_rows


def w8a8_spy(x, w, s, cfg=None, xq=None):
    if xq is not None:
        diff(f"w8a8 N={w.shape[0]}", x, xq)
    return w8a8(x, w, s, cfg, xq=xq)


def grouped_spy(x, *a, xq=None, **kw):
    if xq is not None:
        diff("grouped", x, xq)
    return grouped(x, *a, xq=xq, **kw)


fp8_linear._w8a8, moe_grouped.grouped_rows = w8a8_spy, grouped_spy
g = torch.Generator().manual_seed(7)
lens = torch.randint(3, 300, (6,), generator=g)  # tests/gpu/test_engine_gpu.py's _prompts(6, seed=7)
prompts = [torch.randint(0, 4096, (int(n),), generator=g).tolist() for n in lens]
llm = LLM(model="dummy:metainfer/configs/qwen3.6-35b-a3b.json", device="cuda", dtype="bfloat16",
          quantization="fp8", max_num_seqs=8, max_model_len=512)
outs = Counter()
for name in ("add_rms_norm", "moe_add_rms_norm", "gated_rms_norm"):
    f = ops._KERNELS[name]  # the registry's reference (ops calls it, not the module attribute)

    def spy(*a, _f=f, _name=name, xq_out=None, **kw):
        got = _f(*a, xq_out=xq_out, **kw)
        if xq_out is not None:
            want = _f(*a, **kw)
            pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
            outs[_name, all(torch.equal(g, w) for g, w in pairs)] += 1
        return got

    ops._KERNELS[name] = spy
llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=24, temperature=0,
                                                                    ignore_eos=True))
print("consumers given a copy (where, x shape): calls", dict(calls))
print("norm outputs with the copy == without (op, equal): calls", dict(outs))
print(f"copies that differ from act_quant: {len(bad)}")
for b in bad[:20]:
    print("  ", b)
