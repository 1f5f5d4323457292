"""Batch-1 decode with and without n-gram speculation (KB-0038) on the full config, dummy weights.

Two prompts: 1k random ids, and a 64-token random pattern repeated to 1k (the n-gram proposer's
best case on the prompt side; whether drafts are accepted depends on what the model continues
with, reported as the acceptance). Decode tok/s = (tokens - 1) / (end-to-end - TTFT), median of
`--reps` runs; the greedy tokens with and without speculation are compared.

Dummy weights do not repeat themselves the way text does, so the n-gram rows mostly measure the
cost of speculation left idle. The `script-K` rows measure its ceiling: the proposer drafts the plain
run's greedy tokens, K per verify, and every verify is taken as accepting them (`force_acceptance`:
on dummy weights verify and decode rows part at near-ties within a few tokens): what a drafter of
perfect acceptance would give at this verify cost. An upper bound, not a figure for real text, and
not a correctness check (the GPU tests and the oracle's --speculative repeat are).

`mtp` rows draft with the checkpoint's MTP layer (`--speculative mtp`; on dummy weights its drafts are
noise: the cost of MTP speculation left idle); `mtp-script-K` rows run the MTP drafter (its cost paid:
K chained MTP steps per verify) and then draft the script's tokens, forced accepted: the ceiling of MTP
speculation at perfect acceptance.

    python benchmarks/spec_bench.py --dtype fp8 --gen 256 --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_smoke import env_info  # noqa: E402

from metainfer.config import FULL_CONFIG  # noqa: E402
from metainfer.engine.request import SamplingParams  # noqa: E402
from metainfer.llm import LLM  # noqa: E402


def prompts(vocab: int, n: int = 1024) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    pattern = torch.randint(0, vocab, (64,), generator=g).tolist()
    return {"random": torch.randint(0, vocab, (n,), generator=g).tolist(), "repeated": (pattern * n)[:n]}


# Executor.path -> label
PATHS = {"decode_graph": "decode graph", "prefill_graph": "lone-prefill graph", "eager": "eager"}


def timed_paths(llm: LLM) -> dict[str, list[float]]:
    """Wraps the runner's three executors and the engine's step: wall ms of each step() call by the
    executor its launch took (a synchronous step's time includes its GPU time; an async one's, the
    previous step's)."""
    runner, engine, last = llm.engine.runner, llm.engine, [None]
    times: dict[str, list[float]] = {v: [] for v in PATHS.values()}
    for ex in runner.executors:
        def wrapped(*a, _f=ex.run, _label=PATHS[ex.path]):
            last[0] = _label
            return _f(*a)
        ex.run = wrapped
    step = engine.step

    def timed_step():
        last[0] = None
        t0 = time.perf_counter()
        out = step()
        if last[0] is not None:
            times[last[0]].append((time.perf_counter() - t0) * 1e3)
        return out

    engine.step = timed_step
    return times


def profile_run(llm: LLM, prompt: list[int], gen: int) -> list[dict]:
    """Kernel totals over one generate of `gen` tokens (its 1k prefill included: the first row group)."""
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True, detokenize=False)
    steps0 = llm.engine.stats["steps"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt_token_ids=[prompt], sampling_params=sp)
    steps = llm.engine.stats["steps"] - steps0
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append({"kernel": ev.key[:80], "calls": ev.count, "us": t, "steps": steps})
    return sorted(rows, key=lambda r: -r["us"])


@contextlib.contextmanager
def record_verifies(llm: LLM, n: int):
    """The engine's first n verifies while inside: (output position, drafts, greedy tokens) each, to
    see where a scripted run leaves its script (the greedy token at a position against the last try's)."""
    eng, log = llm.engine, []
    accept = eng._accept

    def spy(req, n_tok, inflight, now):
        if len(log) < n:
            greedy = inflight.verify[req.request_id]
            log.append((len(req.output_token_ids), list(req.draft_token_ids), list(greedy)))
        return accept(req, n_tok, inflight, now)

    eng._accept = spy
    try:
        yield log
    finally:
        del eng._accept  # the class method again


def force_acceptance(llm: LLM, script: list[int]) -> None:
    """Every verify taken as accepting its drafts (and the script's next token as its own): the
    scripted runs emit plain's tokens exactly and pay the verify path's cost at full acceptance. On
    dummy weights a verify row and a decode row part at near-ties within a few tokens (top-2 gaps of
    0-0.25 nats are common; 2026-11-30m: left at token 2 with K = 2 and 4), so unforced drafts of
    plain's tokens measure the rejection path, not the ceiling."""
    eng = llm.engine
    accept = eng._accept

    def forced(req, n_tok, inflight, now):
        m, d = len(req.output_token_ids), len(req.draft_token_ids)
        want, greedy = script[m : m + d + 1], inflight.verify[req.request_id]
        inflight.verify[req.request_id] = want + list(greedy[len(want) :])  # past the script: the model's
        return accept(req, n_tok, inflight, now)

    eng._accept = forced


def run(llm: LLM, prompt: list[int], gen: int, reps: int) -> dict:
    sp = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate(prompt_token_ids=[prompt], sampling_params=sp)  # warm: shapes compiled
    speeds, st0 = [], dict(llm.engine.stats)
    times = timed_paths(llm)
    for _ in range(reps):
        o = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
        speeds.append((len(o.token_ids) - 1) / (o.e2e - o.ttft))
    del llm.engine.step  # the class method again
    keys = ("steps", "async_steps", "spec_verifies", "spec_drafted", "spec_accepted")  # over the timed runs
    st = {k: llm.engine.stats[k] - st0[k] for k in keys}
    paths = {k: {"steps": len(v), "median_ms": statistics.median(v) if v else None} for k, v in times.items()}
    return {"decode_tok_s": statistics.median(speeds), "all_tok_s": speeds, "tokens": o.token_ids,
            "ttft_ms": o.ttft * 1e3, "paths": paths, **st}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp8", choices=["bfloat16", "fp8"])
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--script-k", type=lambda v: [int(x) for x in v.split(",") if x], default=[2, 4],
                    help="K of the scripted (perfect-acceptance) runs")
    ap.add_argument("--modes", type=lambda v: v.split(","), default=["ngram", "script"],
                    help="besides plain (always run: the scripts draft its tokens): ngram, script, mtp, "
                    "mtp-script")
    ap.add_argument("--profile", type=lambda v: v.split(","), default=[],
                    help="modes whose random-prompt run gets a kernel profile (e.g. plain,script-4)")
    ap.add_argument("--profile-gen", type=int, default=24, help="tokens of the profiled generate")
    ap.add_argument("--out", default="out")
    ap.add_argument("--config", default=str(FULL_CONFIG))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--draft-vocab", type=int, default=0, help="mtp modes: speculative_draft_vocab")
    args = ap.parse_args()
    kw = dict(model=f"dummy:{args.config}", device=args.device, dtype="bfloat16", max_num_seqs=4,
              max_model_len=2048, quantization="fp8" if args.dtype == "fp8" else None)
    res = {"env": env_info(), "dtype": args.dtype, "gen": args.gen, "k": args.k, "script_k": args.script_k,
           "draft_vocab": args.draft_vocab, "runs": {}}
    modes = [("plain", None, args.k)] + [("ngram", "ngram", args.k)] * ("ngram" in args.modes)
    modes += [(f"script-{k}", "ngram", k) for k in args.script_k] if "script" in args.modes else []
    modes += [("mtp", "mtp", args.k)] * ("mtp" in args.modes)
    modes += [(f"mtp-script-{k}", "mtp", k) for k in args.script_k] if "mtp-script" in args.modes else []
    truth: dict[str, list[int]] = {}
    gaps: list[float] = []
    for mode, spec, k in modes:
        dv = dict(speculative_draft_vocab=args.draft_vocab) if spec == "mtp" else {}
        llm = LLM(**kw, speculative=spec, num_speculative_tokens=k, **dv)
        ps = prompts(llm.engine.model_config.vocab_size)
        if "script" in mode:
            ps = {"random": ps["random"]}
            script = list(truth["random"])
            llm.engine.proposer = lambda req, kk, script=script: script[len(req.output_token_ids):][:kk]
            if spec == "mtp":  # the MTP drafts computed (their cost), the script's drafted instead
                mtp = llm.engine.runner.mtp.propose
                llm.engine.proposer = lambda req, kk, script=script, mtp=mtp: (
                    mtp(req, kk) and script[len(req.output_token_ids):][:kk])
            sp = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True, detokenize=False)
            with record_verifies(llm, 12) as log:  # unforced: where the verify rows part from plain's
                got = llm.generate(prompt_token_ids=[ps["random"]], sampling_params=sp)[0].token_ids
            parted = next((i for i, (a, b) in enumerate(zip(got, script)) if a != b), None)
            print(f"[{mode}] unforced, the run left plain's tokens at {parted} (plain's top-2 gap there "
                  f"{gaps[parted] if parted is not None and parted < len(gaps) else '-'}); first verifies "
                  f"(position, drafts, greedy): {log[:3]}")
            force_acceptance(llm, script)
        for name, p in ps.items():
            res["runs"][f"{mode}/{name}"] = r = run(llm, p, args.gen, args.reps)
            if "script" in mode:
                r["unforced_parted_at"], r["unforced_verifies"] = parted, log
            if mode == "plain":
                truth[name] = r["tokens"]
                if name == "random":  # plain's top-2 logprob gap per token: where a verify may round apart
                    o = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
                        max_tokens=args.gen, temperature=0, ignore_eos=True, detokenize=False, logprobs=2))[0]
                    gaps[:] = r["top2_gap"] = [t.top[0][1] - t.top[1][1] for t in o.logprobs]
                    print(f"[plain] top-2 logprob gaps, first tokens: {[round(g, 4) for g in gaps[:12]]}")
            if mode in args.profile and name == "random" and torch.cuda.is_available():
                r["profile"] = prof = profile_run(llm, p, args.profile_gen)
                print(f"[{mode}] kernels over one {args.profile_gen}-token generate "
                      f"({prof[0]['steps']} steps, prefill included):")
                for row in prof[:20]:
                    print(f"  {row['us'] / 1e3:8.2f} ms {row['calls']:6d}x  {row['kernel']}")
        del llm
        gc.collect()  # the engine's reference cycles: its memory back before the next engine sizes its cache
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"spec_bench_{args.dtype}.json").write_text(json.dumps(res, indent=1))
    print(f"[{args.dtype}] | mode/prompt | tok/s | vs plain | accepted / drafted | steps | tokens == plain |")
    for key, r in res["runs"].items():
        mode, name = key.split("/")
        a = res["runs"][f"plain/{name}"]
        print(f"| {key} | {r['decode_tok_s']:.0f} | {r['decode_tok_s'] / a['decode_tok_s']:.2f}x | "
              f"{r['spec_accepted']} / {r['spec_drafted']} | {r['steps']} | {r['tokens'] == a['tokens']} |")
    print("step paths (steps, median wall ms of step()):")
    for key, r in res["runs"].items():
        print(f"  {key}: async {r['async_steps']}; " + "; ".join(
            f"{k} {v['steps']} x {v['median_ms']:.2f} ms" for k, v in r["paths"].items() if v["steps"]))


if __name__ == "__main__":
    main()
