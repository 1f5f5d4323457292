"""An A/B of decode-kernel settings in one process: one engine, the decode graphs captured again for each
mode, the modes interleaved over rounds. Against a fresh process a run (~45 s each on the H200, mostly the
engine's start), a mode's run here costs its capture and its decode (~3-5 s), so one call measures more
rounds of more modes.

A mode is "default" or NAME=VALUE pairs joined by commas, NAME a field of `metainfer.settings.Settings` or its
environment variable (pdl=0, METAINFER_PDL=0; an experiment adds its switch there as a field while it runs).
Before each run the mode's values replace the process's (`settings.override`) and the decode graphs are
captured again (ModelRunner.recapture_decode). So only settings read while the decode step is captured (or
run eagerly) compare this way; not those read when the model is loaded or the prefill graphs captured. Each
run is decode_bench's `decode_run` (a fresh 1k-token prompt, greedy, ignore_eos): the engine's step time, as
the fresh-process A/B measures it, plus the graph's replay time and the greedy tokens' fingerprint (modes
that compute the same give the same; a difference is reported, not judged: that is the oracle's job).

    python benchmarks/ab_inproc.py --dtype fp8 --rounds 3 --modes default pdl=0 --out $OUT/ab
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import decode_run, graph_replay_ms, profile_decode  # noqa: E402
from engine_smoke import env_info  # noqa: E402

from metainfer import settings  # noqa: E402
from metainfer.bench.critical_path import layer_table  # noqa: E402
from metainfer.config import FULL_CONFIG  # noqa: E402
from metainfer.llm import LLM  # noqa: E402

# settings this A/B cannot compare: read at start-up or when the model is loaded, or not by the decode kernels
NOT_IN_PROCESS = ("api_key", "cache_dir", "triton_interpret", "git_commit")
FIELDS = {**{f: f for f in settings.ENV}, **{v: f for f, v in settings.ENV.items()}}  # name or variable


def parse_mode(mode: str) -> dict[str, object]:
    """ "default" -> {}; "pdl=0,METAINFER_FP8_TUNED=t.json" -> {"pdl": False, "fp8_tuned": Path("t.json")}:
    the settings' fields, typed; an unknown name, a bad value or a setting this A/B cannot compare is
    refused."""
    if mode == "default":
        return {}
    out = {}
    for part in mode.split(","):
        name, eq, value = part.partition("=")
        if not eq or not name or not name.isidentifier():
            raise ValueError(f"mode {mode!r}: {part!r} is not NAME=VALUE")
        if name not in FIELDS:
            raise ValueError(f"mode {mode!r}: {name} is not a field of metainfer.settings.Settings")
        field = FIELDS[name]
        if field in NOT_IN_PROCESS:
            raise ValueError(f"mode {mode!r}: {name} is read at start-up or load only: A/B it in fresh "
                             "processes")
        out[field] = settings.parse(field, value)
    return out


def round_order(n_modes: int, rnd: int) -> list[int]:
    """The modes' order in round rnd: as given in even rounds, reversed in odd ones, so that no mode always
    runs first (after the engine's start, or after the same other mode)."""
    order = list(range(n_modes))
    return order[::-1] if rnd % 2 else order


class Switches:
    """Holds one mode's settings at a time (`settings.override`); the process's own are back between modes
    and after `restore`."""

    def __init__(self) -> None:
        self._held = contextlib.ExitStack()

    def apply(self, mode: dict[str, object]) -> None:
        self._held.close()
        if mode:
            self._held.enter_context(settings.override(**mode))

    def enter(self, llm: LLM, mode: dict[str, object]) -> None:
        """The mode's settings in force, the decode graphs captured again under them."""
        self.apply(mode)
        llm.engine.runner.recapture_decode()

    def restore(self) -> None:
        self.apply({})


def run_mode(llm: LLM, mode: dict[str, object], switches: Switches, batch: int, prompt_len: int, gen: int,
             seed: int) -> dict:
    t0 = time.perf_counter()
    switches.enter(llm, mode)
    capture_s = time.perf_counter() - t0
    r = decode_run(llm, batch, prompt_len, gen, seed)
    r["capture_s"] = capture_s
    if batch == 1 and llm.engine.runner.device.type == "cuda":
        r["graph_replay_ms"] = graph_replay_ms(llm, 1)
    return r


def profile_mode(llm: LLM, mode: dict[str, object], switches: Switches, batch: int, prompt_len: int) -> dict:
    """One profiled decode (decode_bench's profile_decode, PDL as the engine runs it) in the mode: its
    kernels' exposed times and, at batch 1, the layer table (the median DeltaNet and attention layer, by
    kernel: critical_path.layer_table)."""
    switches.enter(llm, mode)
    _rows, exposed, timeline = profile_decode(llm, prompt_len, batch=batch)
    out = {"exposed": exposed[:16]}
    if timeline and batch == 1:
        out["layers"] = layer_table(timeline)
    return out


def summarise(modes: list[str], runs: list[dict]) -> list[dict]:
    """Each mode's median tok/s, step and replay ms over its runs, its greedy fingerprints, and whether they
    match the first mode's."""
    base = {r["tokens_sha1"] for r in runs if r["mode"] == modes[0]}
    rows = []
    for m in modes:
        mine = [r for r in runs if r["mode"] == m]
        if not mine:
            continue
        replay = [r["graph_replay_ms"] for r in mine if r.get("graph_replay_ms")]
        shas = sorted({r["tokens_sha1"] for r in mine})
        rows.append({
            "mode": m,
            "runs": len(mine),
            "tok_s_median": statistics.median(r["decode_tok_s"] for r in mine),
            "tok_s_all": [round(r["decode_tok_s"], 1) for r in mine],
            "step_ms_median": statistics.median(r["step_ms_median"] for r in mine),
            "graph_replay_ms_median": statistics.median(replay) if replay else None,
            "tokens_sha1": shas,
            "tokens_as_first_mode": set(shas) == base,
            "runs_with_errors": sum(bool(r.get("errors")) for r in mine),
        })
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(FULL_CONFIG))
    ap.add_argument("--dtype", default="fp8", choices=["bfloat16", "fp8"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", nargs="+", default=["default"], help='"default" or NAME=VALUE[,NAME=VALUE]')
    ap.add_argument("--rounds", type=int, default=3, help="each mode once a round (odd rounds reversed)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=0, help="default: prompt + gen + 64")
    ap.add_argument("--profile", action="store_true",
                    help="after the rounds, one profiled decode a mode: its layer table (batch 1)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    modes = list(dict.fromkeys(args.modes))
    parsed = [parse_mode(m) for m in modes]
    switches = Switches()
    t0 = time.perf_counter()
    llm = LLM(model=f"dummy:{args.config}", device=args.device, dtype="bfloat16",
              quantization="fp8" if args.dtype == "fp8" else None,
              max_model_len=args.max_model_len or args.prompt_len + args.gen + 64, max_num_seqs=args.batch,
              max_num_batched_tokens=8192)
    print(f"engine init {time.perf_counter() - t0:.1f}s; modes {modes}, {args.rounds} rounds", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"env": env_info(), "config": args.config, "dtype": args.dtype, "batch": args.batch,
           "prompt_len": args.prompt_len, "gen": args.gen, "rounds": args.rounds, "runs": [], "summary": [],
           "profiles": {}, "failed": []}

    def save() -> None:  # after every run: a later failure or timeout keeps what was measured
        res["summary"] = summarise(modes, res["runs"])
        (out / f"ab_inproc_{args.dtype}.json").write_text(json.dumps(res, indent=1))

    try:
        # a discarded first run: the first measured one does not follow the engine's start
        run_mode(llm, parsed[0], switches, args.batch, args.prompt_len, min(args.gen, 16), seed=999)
        for rnd in range(args.rounds):
            for i in round_order(len(modes), rnd):
                # the same prompt for every mode of a round (its greedy tokens comparable), a new one a round
                try:
                    r = run_mode(llm, parsed[i], switches, args.batch, args.prompt_len, args.gen,
                                 seed=1000 + rnd)
                except RuntimeError as e:  # decode_run's failed steps (after a CUDA error: no more runs)
                    res["failed"].append({"mode": modes[i], "round": rnd, "error": repr(e)[:300]})
                    print(f"[{modes[i]} {rnd}] failed: {e!r}"[:300], flush=True)
                    save()
                    if "CUDA" in str(e) or "cuda" in str(e):
                        raise
                    continue
                r.update(mode=modes[i], round=rnd)
                res["runs"].append(r)
                save()
                print(f"[{modes[i]} {rnd}] {r['decode_tok_s']:.1f} tok/s, step {r['step_ms_median']:.3f} ms, "
                      f"replay {r.get('graph_replay_ms') or 0:.3f} ms, tokens {r['tokens_sha1']}, "
                      f"capture {r['capture_s']:.1f}s{'  ERRORS ' + str(r['errors']) if r['errors'] else ''}",
                      flush=True)
        if args.profile and llm.engine.runner.device.type == "cuda":  # (the profile is of CUDA kernels)
            for m, sw in zip(modes, parsed):
                res["profiles"][m] = profile_mode(llm, sw, switches, args.batch, args.prompt_len)
                save()
    finally:
        switches.restore()
    save()
    profiles = res["profiles"]
    print(f"\n[{args.dtype} batch {args.batch}] | mode | tok/s (median) | runs | step ms | replay ms "
          f"| tokens as {modes[0]} |")
    for s in res["summary"]:
        replay = f"{s['graph_replay_ms_median']:.3f}" if s["graph_replay_ms_median"] else "-"
        same = "yes" if s["tokens_as_first_mode"] else "NO"
        errs = f" ERRORS in {s['runs_with_errors']} runs" if s["runs_with_errors"] else ""
        print(f"| {s['mode']} | {s['tok_s_median']:.1f} | {s['tok_s_all']} | {s['step_ms_median']:.3f} "
              f"| {replay} | {same}{errs} |")
    for f in res["failed"]:
        print(f"| {f['mode']} | failed in round {f['round']}: {f['error'][:120]} |")
    for m, prof in profiles.items():  # the layers' kernels side by side (exposed us, medians)
        for kind, t in prof.get("layers", {}).items():
            parts = ", ".join(f"{k['kernel'][:28]} {k['exposed_us']:.2f}" for k in t["kernels"])
            print(f"[{m}] {kind} layer {t['period_us']:.1f} us: {parts}")
    return res


if __name__ == "__main__":
    main()
