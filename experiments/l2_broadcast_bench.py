"""How long do 132 CTAs take to read the same L2-resident words? The megakernel's hops broadcast each
op's tagged 8-byte output words to every CTA (out_proj: z and x, 64 KB per CTA, 8.4 MB in all), and
its profile shows out_proj's polls finishing ~4 µs after the data is ready (2026-12-03). This bench
times that broadcast alone: one program per SM, released together by a counter, each reading
`kb` KB of 8-byte words through L2 (.cg loads) from the same buffer ("same") or from its
own ("own"), timed in the kernel by %globaltimer (the span from the first program's start to the
last one's end). Halving the bytes (two bf16 values under one 32-bit tag) halves which figure?

  python experiments/l2_broadcast_bench.py --json $OUT/l2_broadcast.json      (~20 s on the H200)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _bcast(buf, out, ctr, ts, n_words, prog_stride, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    tl.atomic_add(ctr, 1)
    seen = tl.atomic_add(ctr, 0)
    while seen < n_prog:  # every program resident (grid <= SMs) and released together
        seen = tl.atomic_add(ctr, 0)
    t0 = _now()
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    base = buf + pid * prog_stride
    for off in range(0, n_words, BLOCK):
        acc ^= tl.load(base + off + offs, cache_modifier=".cg")
    t1 = _now()
    tl.store(out + pid * BLOCK + offs, acc)
    tl.store(ts + 2 * pid, t0)
    tl.store(ts + 2 * pid + 1, t1)


def run(kb: int, same: bool, programs: int, block: int, warps: int, reps: int) -> dict:
    n_words = kb * 1024 // 8
    block = min(block, n_words)
    buf = torch.randint(0, 2**40, (n_words * (1 if same else programs),), dtype=torch.int64, device="cuda")
    out = torch.empty(programs * block, dtype=torch.int64, device="cuda")
    ts = torch.empty(2 * programs, dtype=torch.int64, device="cuda")
    spans, per_prog = [], []
    for _ in range(reps + 1):  # (the first: the buffer into L2)
        ctr = torch.zeros(1, dtype=torch.int32, device="cuda")
        _bcast[(programs,)](buf, out, ctr, ts, n_words, 0 if same else n_words, BLOCK=block, num_warps=warps)
        t = ts.view(programs, 2).cpu()
        spans.append((t[:, 1].max() - t[:, 0].min()).item() / 1e3)
        per_prog.append(statistics.median((t[:, 1] - t[:, 0]).tolist()) / 1e3)
    want = buf[:n_words].view(1, -1) if same else buf.view(programs, n_words)
    ref = torch.zeros(programs, block, dtype=torch.int64, device="cuda")
    for off in range(0, n_words, block):
        ref ^= want[:, off:off + block].expand(programs, block) if same else want[:, off:off + block]
    if not torch.equal(ref.view(-1), out):
        raise AssertionError("broadcast bench: the programs' xors differ from the buffer's")
    span = statistics.median(spans[1:])
    return dict(kb=kb, same=same, programs=programs, block=block, warps=warps, span_us=span,
                prog_median_us=statistics.median(per_prog[1:]),
                tb_per_s=programs * kb * 1024 / (span * 1e-6) / 1e12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kb", default="8,16,32,64")
    ap.add_argument("--programs", type=int, default=0, help="0: the SM count")
    ap.add_argument("--block", type=int, default=2048, help="words per program per iteration")
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    programs = a.programs or torch.cuda.get_device_properties(0).multi_processor_count
    rows = [run(kb, same, programs, a.block, a.warps, a.reps) for same in (True, False)
            for kb in map(int, a.kb.split(","))]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), rows=rows), f, indent=1)
    print(f"{'KB/CTA':>7} {'source':>6} {'span µs':>8} {'CTA µs':>7} {'TB/s':>6}  ({programs} CTAs)")
    for r in rows:
        src = "same" if r["same"] else "own"
        print(f"{r['kb']:>7} {src:>6} {r['span_us']:8.2f} {r['prog_median_us']:7.2f} {r['tb_per_s']:6.2f}")


if __name__ == "__main__":
    main()
