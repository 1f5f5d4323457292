# History: the megakernel left the product. This script imports its code (metainfer.kernels.mega), whose last
# commit is b4eb65f: run it from that tree (git worktree add /tmp/mega b4eb65f). Kept as the record of
# KB-0075..0091.
# ruff: noqa: I001  (metainfer.kernels.mega is not in this tree: isort would take it for a third-party module)
"""The megakernel's batch-1 decode step on the full config (dummy FP8 weights) against the engine's.

An engine (FP8, dummy weights, eager, synchronous scheduling) prefills one random 1k-token prompt and
samples its first token. From that state, one decode step runs twice: through the engine's model
forward (its Triton kernels) and through the megakernel program built from the same weights and caches
(build_step.decode_program), each from the same saved states. Printed: the logits' relative RMSE and
argmax agreement, the DeltaNet states' and this step's key's differences, for each consumer kind (the
CUDA cores; the tensor cores, MegaKernel.launch(mma=True)); then the megakernel step's time for each
consumer kind and L2 lead (median of --reps launches; the states advance between launches, which moves
no byte counts), its tok/s and its % of the byte floor at 4.3 TB/s. The engine's own decode rate is
decode_bench.py's.

  python experiments/mega_step.py --json out/mega_step.json [--fp8-lm-head] [--prompt-len 1024] [--reps 50]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' helpers
from engine_smoke import env_info  # noqa: E402

from metainfer.config import FULL_CONFIG  # noqa: E402
from metainfer.engine.request import SamplingParams  # noqa: E402
from metainfer.forward_meta import ForwardMeta  # noqa: E402
from metainfer.kernels.mega import build_step, launch, profile  # noqa: E402
from metainfer.kernels.mega import program as P  # noqa: E402
from metainfer.kernels.mega.launch import MegaKernel  # noqa: E402
from metainfer.llm import LLM  # noqa: E402

HBM = 4.3e12


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def compare(engine_snap, mega_snap, logits: torch.Tensor, want: torch.Tensor) -> dict:
    """The megakernel's step against the engine's: logits, the slot's DeltaNet states, this step's KV rows."""
    (ce, se), re_ = engine_snap
    (cm, sm), rm = mega_snap
    return {
        "logits_rel_rmse": rel(logits, want),
        "argmax_equal": int(logits.argmax()) == int(want.argmax()),
        "top5_overlap": len(set(logits.topk(5).indices.tolist()) & set(want.topk(5).indices.tolist())),
        "conv_state_rel_rmse": rel(cm.float(), ce.float()),
        "ssm_state_rel_rmse": rel(sm, se),
        "new_kv_rel_rmse": max(rel(a.float(), b.float()) for a, b in zip(rm, re_)),
        "finite": bool(torch.isfinite(logits).all()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=1, help="timing rounds, interleaving the configurations")
    ap.add_argument("--splits", type=int, default=8)
    ap.add_argument("--fp8-lm-head", action="store_true")
    ap.add_argument("--leads", default="0,131072,262144",
                    help="L2 leads to time (bytes per CTA prefetched before each routing wait; 0: off)")
    ap.add_argument("--variants", default="",
                    help="kernel builds to compare: ';'-separated, each ','-separated -D flags ('': default)")
    ap.add_argument("--ref-src", type=Path,
                    help="a folder with another tree's megakernel sources (mega.cu and its parts), timed as "
                         "variant 'ref' beside the others (an A/B of sources in one process)")
    ap.add_argument("--arena", default="1", help="output layouts to time: 1 one arena, 0 one allocation each")
    ap.add_argument("--inflight", default="6",
                    help="the producer's chunks in flight to time (MegaKernel.launch)")
    ap.add_argument("--mma", default="0,1", help="consumer kinds to time: 0 CUDA cores, 1 tensor cores")
    ap.add_argument("--prof", action="store_true",
                    help="then each kind once in the profiling build (profile.py): where the time goes")
    args = ap.parse_args()
    llm = LLM(model=f"dummy:{FULL_CONFIG}", device="cuda", dtype="bfloat16", quantization="fp8",
              fp8_lm_head=args.fp8_lm_head, max_model_len=args.prompt_len + 64, max_num_seqs=1,
              enforce_eager=True, async_scheduling=False)
    eng, runner = llm.engine, llm.engine.runner
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, runner.model.cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
    eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while not (eng.scheduler.running and eng.scheduler.running[0].output_token_ids):
        eng.step()
    req = eng.scheduler.running[0]
    eng.scheduler.cache.grow(req, 1)  # the decode position's block (the scheduler's next step would take it)
    bs = runner.ecfg.block_size
    token, pos, slot = req.output_token_ids[-1], req.num_computed_tokens, req.state_slot
    kv_slot = req.block_ids[pos // bs] * bs + pos % bs
    model, caches = runner.model, runner.caches

    def snapshot():
        return ([t[:, slot].clone() for t in (runner.conv_states, runner.ssm_states)],
                [(c.view(-1, *c.shape[2:])[kv_slot].clone()) for c in caches.k + caches.v])

    def restore(snap):
        (conv, ssm), rows = snap
        runner.conv_states[:, slot].copy_(conv)
        runner.ssm_states[:, slot].copy_(ssm)
        for c, r in zip(caches.k + caches.v, rows):
            c.view(-1, *c.shape[2:])[kv_slot].copy_(r)

    before = snapshot()
    with torch.no_grad():  # the engine's step
        meta = ForwardMeta.build([1], [pos], [req.block_ids], [slot], bs, [0], "cuda")
        hidden = model(torch.tensor([token], device="cuda"), torch.tensor([pos], device="cuda"), meta, caches)
        want = model.compute_logits(hidden)[0].float()
    after_engine = snapshot()
    restore(before)

    # the kernel builds compared: name -> -D flags ("base": none)
    variants = {(v or "base"): tuple(d for d in v.split(",") if d) for v in args.variants.split(";")}
    srcs = {v: launch.HERE for v in variants}
    if args.ref_src:
        variants["ref"], srcs["ref"] = (), args.ref_src
    kernels = {v: MegaKernel("cuda", defines=d, src=srcs[v]) for v, d in variants.items()}
    bt = torch.zeros(runner.blocks_per_seq, dtype=torch.int32, device="cuda")
    bt[: len(req.block_ids)] = torch.tensor(req.block_ids, dtype=torch.int32)
    logits = torch.zeros(model.cfg.vocab_size, device="cuda")
    step = torch.zeros(P.STEP_WORDS, dtype=torch.int64, device="cuda")
    build_step.step_inputs(step, token, pos, kv_slot, slot, True, pos + 1)
    instrs = build_step.decode_program(model, caches, bt, logits, splits=args.splits)
    progs = {a: P.Program(instrs, step=step, arena=bool(a)) for a in [int(v) for v in args.arena.split(",")]}
    prog = next(iter(progs.values()))
    mmas = [int(v) for v in args.mma.split(",")]
    check = {}
    for (name, kernel), mma in [(kv, m) for kv in kernels.items() for m in mmas]:  # each from saved states
        restore(before)
        kernel.launch(prog, mma=bool(mma), inflight=int(args.inflight.split(",")[0]))  # (the first listed)
        torch.cuda.synchronize()
        if prog.error():
            raise SystemExit(f"megakernel ({name}, mma {mma}): {prog.error()}")
        key = f"mma{mma}" + (f"_{name}" if len(kernels) > 1 else "")
        check[key] = compare(after_engine, snapshot(), logits, want)
    # every configuration timed `reps` launches (after 3 warm-ups) per round, the rounds interleaving them (a
    # drift of the GPU's clocks or temperature falls on all alike); the median over all rounds' launches
    cases = [(name, kernel, arena, pr, mma, int(a), int(b)) for name, kernel in kernels.items()
             for arena, pr in progs.items() for mma in mmas
             for a in args.leads.split(",") for b in args.inflight.split(",")]
    runs: dict[int, list[list[float]]] = {k: [] for k in range(len(cases))}
    for _ in range(args.rounds):
        for k, (_, kernel, _, pr, mma, lead, infl) in enumerate(cases):
            ms = []
            for i in range(args.reps + 3):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                kernel.launch(pr, lead=lead, mma=bool(mma), inflight=infl)
                b.record()
                b.synchronize()
                if i >= 3:
                    ms.append(a.elapsed_time(b))
            runs[k].append(ms)
    timings = []
    for k, (name, _, arena, pr, mma, lead, infl) in enumerate(cases):
        ms = sorted(v for r in runs[k] for v in r)
        med = ms[len(ms) // 2]
        rounds = [sorted(r)[len(r) // 2] for r in runs[k]]
        timings.append({"variant": name, "mma": mma, "arena": arena, "lead": lead, "inflight": infl,
                        "ms_median": med, "ms_min": ms[0], "ms_max": ms[-1], "round_medians": rounds,
                        "tok_s": 1e3 / med, "pct_of_floor": 100 * pr.bytes / HBM / (med * 1e-3)})
    profiles = {}
    if args.prof:
        for name, defines in variants.items():
            pk = MegaKernel("cuda", prof=True, defines=defines, src=srcs[name])
            for (arena, pr), mma in [(ap, m) for ap in progs.items() for m in mmas]:
                mine = [t for t in timings if (t["mma"], t["arena"], t["variant"]) == (mma, arena, name)]
                best = min(mine, key=lambda t: t["ms_median"])
                buf = profile.record(pk, pr, mma=bool(mma), lead=best["lead"], inflight=best["inflight"])
                key = f"mma{mma}_arena{arena}" + (f"_{name}" if len(variants) > 1 else "")
                profiles[key] = profile.summarize(buf, pr.instrs, pk.num_sms) | {"inflight": best["inflight"]}
                # the first DeltaNet and attention layers, instruction by instruction (the hops' costs)
                profiles[key]["timeline"] = profile.timeline(buf, pr.instrs, pk.num_sms, 0,
                                                             min(30, len(pr.instrs)))
                profiles[key]["routing"] = profile.routing(buf, pr.instrs, pk.num_sms)
                if args.json:
                    torch.save(buf.cpu(), args.json.with_name(f"{args.json.stem}_prof_{len(profiles)}.pt"))
    restore(before)
    for pr in progs.values():
        if pr.error():
            raise SystemExit(f"megakernel: {pr.error()}")
    code = {name: launch.text_bytes(launch.build(defines=d, src=srcs[name]))  # (the cached cubins)
            for name, d in variants.items()}
    res = {"instructions": len(prog.instrs), "weight_bytes": prog.bytes, "code_bytes": code,
           "timings": timings, "check": check, "profiles": profiles}
    print(f"megakernel step, full config, FP8 (lm_head {'FP8' if args.fp8_lm_head else 'BF16'}), "
          f"{args.prompt_len}-token context, {torch.cuda.get_device_name()}, "
          f"{len(prog.instrs)} instructions, {prog.bytes / 1e9:.3f} GB")
    print("check:", json.dumps(check))
    print("code bytes:", json.dumps(code))
    for k, sm in profiles.items():
        print(f"\n{k} (profiling build, at its fastest lead and chunks in flight)\n" + profile.table(sm))
        print("routing, us after the router's last CTA out (medians over the layers):",
              json.dumps({a: round(b, 2) for a, b in sm["routing"].items()}))
    print("| variant | consumers | output arena | L2 lead (bytes per CTA) | chunks in flight | ms (median) "
          "| rounds' medians | tok/s | % of 4.3 TB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in timings:
        kind = "tensor cores" if t["mma"] else "CUDA cores"
        print(f"| {t['variant']} | {kind} | {t['arena']} | {t['lead']} | {t['inflight']} | "
              f"{t['ms_median']:.3f} | {' '.join(f'{v:.3f}' for v in t['round_medians'])} | "
              f"{t['tok_s']:.0f} | {t['pct_of_floor']:.1f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        argv = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"env": env_info(), "args": argv,
                                         "results": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
