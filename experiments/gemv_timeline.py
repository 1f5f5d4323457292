"""One decode step's gemv.cu launches CTA by CTA (the qkv / in_proj with its x prologue, the experts'
gate/up): when each CTA came in, when its griddepcontrol.wait returned, when its prologue had summed the MoE
rows and staged x, when its first chunk was in and when it was done, on one time axis
(metainfer/kernels/cuda/gemv_timeline.py). The question it answers: of the qkv / in_proj's ~9 µs after the
experts' down, how much is the prologue and how much the chunks.

Runs the FP8 engine at batch 1 on the full config with dummy weights, gemv.cu's timeline build
(gemv.use_timeline_build), for each mode (as benchmarks/ab_inproc.py's: "default" or NAME=VALUE settings; the
decode graphs captured again
under each): a 1k-token prompt decoded for --gen tokens, then the batch-1 decode graph replayed --steps times
with the records read after each. Also the replay's time in the default build, and in the timeline build with
its records off and on (what the stamps cost).

    python experiments/gemv_timeline.py --modes default pdl=0 --out $OUT/timeline
    python experiments/gemv_timeline.py --plot timeline/gemv_timeline.json --out timeline   (CPU: the plots)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' helpers
from ab_inproc import Switches, parse_mode  # noqa: E402
from decode_bench import decode_run, graph_replay_ms  # noqa: E402
from engine_smoke import env_info  # noqa: E402

from metainfer.config import FULL_CONFIG  # noqa: E402
from metainfer.kernels.cuda import gemv  # noqa: E402
from metainfer.kernels.cuda import gemv_timeline as T  # noqa: E402
from metainfer.llm import LLM  # noqa: E402

# the step's gemv.cu launches by kernel and rows (the full config: the DeltaNet in_proj's 12,352 rows with its
# conv; the attention qkv's 9,216 with its output gate; the experts' 9 x 1,024 gate/up rows)
NAMES = {("gemv_e4m3", 12352): "layer 0's in_proj", ("gemv_e4m3_pre", 12352): "DeltaNet in_proj",
         ("gemv_e4m3_pre", 9216): "attention qkv"}


def label(ln: T.Launch, prev: T.Launch | None) -> str:
    """The experts' gate/up named by its layer (the launch before it: the in_proj or the qkv)."""
    if ln.kind == "moe_gate_up_e4m3":
        layer = "attention" if prev is not None and prev.n_rows == 9216 else "DeltaNet"
        return f"experts' gate/up ({layer} layer)"
    return NAMES.get((ln.kind, ln.n_rows), T.default_label(ln, prev))


def timeline_build(on: bool) -> None:
    """gemv.cu's timeline build (on) or its default build, loaded at the next capture."""
    gemv.use_timeline_build(on)
    gemv.reset()


def run_mode(llm: LLM, mode: dict[str, object], switches: Switches, args: argparse.Namespace,
             seed: int) -> dict:
    dev = llm.engine.runner.device
    out: dict = {}
    if args.baseline:  # the default build's replay, same mode
        timeline_build(False)
        switches.enter(llm, mode)
        decode_run(llm, 1, args.prompt_len, args.gen, seed)
        out["replay_ms_default_build"] = graph_replay_ms(llm, 1)
    timeline_build(True)
    switches.enter(llm, mode)
    r = decode_run(llm, 1, args.prompt_len, args.gen, seed)
    out.update(decode_tok_s=r["decode_tok_s"], tokens_sha1=r["tokens_sha1"], errors=r["errors"])
    out["replay_ms_records_off"] = graph_replay_ms(llm, 1)
    rec = T.Recorder(dev, slots=args.slots)
    out["replay_ms_records_on"] = graph_replay_ms(llm, 1)
    graph = llm.engine.runner.decode.graphs[1]
    steps = []
    for _ in range(args.steps):
        rec.clear()
        graph.replay()
        steps.append(T.decode(rec.read()))
    rec.close()
    out["launches_a_step"] = [len(s) for s in steps]
    out["step_span_us"] = [round(s[-1].end_us - s[0].t0_us, 2) for s in steps if s]
    out["summary"] = T.summarize(steps, label)
    out["first_step"] = [  # one step's launches in full (each CTA's events, µs), for plots
        {"seq": ln.seq, "label": label(ln, steps[0][i - 1] if i else None), "t0_us": round(ln.t0_us, 3),
         "events": {e: [round(v, 3) for v in vs] for e, vs in ln.events.items()},
         "waits": {w: [round(v, 3) for v in vs] for w, vs in ln.waits.items()}}
        for i, ln in enumerate(steps[0])] if steps and steps[0] else []
    return out


PHASES = (("in", "wait", "#c8c8c8", "entry to wait"), ("wait", "x", "#f28e2b", "wait to x staged"),
          ("x", "first", "#edc948", "x to first chunk"), ("first", "end", "#4e79a7", "first chunk to end"))


def plot_step(first_step: list[dict], png: Path, lo: int = 8, n: int = 8) -> None:
    """first_step's launches lo .. lo + n (a run's JSON, `run_mode`'s "first_step") as bands of CTAs on the
    step's time axis, each CTA's phases coloured (PHASES): where each launch's time goes. On the CPU, from
    a saved JSON: `--plot RUN_JSON` (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lns = first_step[lo:lo + n]
    if not lns:
        raise ValueError(f"no launches {lo}..{lo + n} in a step of {len(first_step)}")
    t_ref = lns[0]["t0_us"]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.9 * len(lns)))
    y = 0
    ticks = []
    for ln in lns:
        ev = ln["events"]
        grid = len(ev["in"])
        for a, b, color, name in PHASES:  # one bar a CTA (a phase it did not record: none)
            rows = [(y + c, ln["t0_us"] - t_ref + s, e - s) for c, (s, e) in enumerate(zip(ev[a], ev[b]))
                    if s == s and e == e]
            if rows:
                ys, lefts, widths = zip(*rows)
                ax.barh(ys, widths, left=lefts, height=1.0, color=color, linewidth=0,
                        label=name if not ticks else None)
        ticks.append((y + grid / 2, ln["label"]))
        y += grid + 8
    ax.set_yticks([t for t, _ in ticks], [name for _, name in ticks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("µs from the first launch shown")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title("gemv.cu launches of one decode step, CTA by CTA (gemv_timeline.py)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(FULL_CONFIG))
    ap.add_argument("--modes", nargs="+", default=["default"], help='"default" or NAME=VALUE[,NAME=VALUE]')
    ap.add_argument("--steps", type=int, default=8, help="graph replays recorded a mode")
    ap.add_argument("--slots", type=int, default=256, help="launches the records hold (>= a step's)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the default build's replay time")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--plot", metavar="RUN_JSON", help="no run: plot each mode's first step from a saved "
                    "gemv_timeline.json into --out (CPU)")
    ap.add_argument("--plot-from", type=int, default=8,
                    help="the first launch plotted (8: layer 4's in_proj, then layers 4-7)")
    args = ap.parse_args(argv)
    if args.plot:
        saved = json.loads(Path(args.plot).read_text())
        Path(args.out).mkdir(parents=True, exist_ok=True)
        for i, (m, r) in enumerate(saved["modes"].items()):
            png = Path(args.out) / f"gemv_timeline_{i}.png"
            plot_step(r["first_step"], png, lo=args.plot_from)
            print(f"{m}: {png}")
        return saved
    modes = list(dict.fromkeys(args.modes))
    parsed = [parse_mode(m) for m in modes]
    switches = Switches()
    gemv.use_timeline_build(True)  # the first load: the timeline build
    t0 = time.perf_counter()
    llm = LLM(model=f"dummy:{args.config}", device="cuda", dtype="bfloat16", quantization="fp8",
              max_model_len=args.prompt_len + args.gen + 64, max_num_seqs=1, max_num_batched_tokens=8192)
    print(f"engine init {time.perf_counter() - t0:.1f}s; modes {modes}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"env": env_info(), "config": args.config, "dtype": "fp8", "batch": 1,
           "prompt_len": args.prompt_len, "gen": args.gen, "steps": args.steps, "modes": {}}
    try:
        decode_run(llm, 1, args.prompt_len, 16, seed=999)  # (a discarded first run)
        for m, p in zip(modes, parsed):
            res["modes"][m] = run_mode(llm, p, switches, args, seed=1000)
            (out / "gemv_timeline.json").write_text(json.dumps(res, indent=1))
    finally:
        switches.restore()
    for m, r in res["modes"].items():
        base = r.get("replay_ms_default_build")
        print(f"\n[{m}] {r['decode_tok_s']:.1f} tok/s (timeline build), tokens {r['tokens_sha1']}; "
              f"replay ms: default build {base or float('nan'):.3f}, records off "
              f"{r['replay_ms_records_off']:.3f}, on {r['replay_ms_records_on']:.3f}; launches a step "
              f"{sorted(set(r['launches_a_step']))}, gemv span {r['step_span_us'][:3]} us")
        print("µs from each launch's first CTA entry: median CTA / last CTA")
        print(T.table(r["summary"]))
    return res


if __name__ == "__main__":
    main()
