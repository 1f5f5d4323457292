"""Engine decode throughput, TTFT and a per-kernel profile on the full config (dummy weights).

For each batch size: `batch` random 1k-token prompts run together (greedy, ignore_eos); the
steady decode step time (all sequences decoding, CUDA-graph replay when available) gives tok/s,
shown with its % of the memory-bandwidth ceiling. TTFT: one 1k-token prompt on an idle engine,
max_tokens=1, median of 9, measured first (fresh engine) and again after the decode runs (the
second figure has moved by up to 40 ms in one process, 2026-11-30).
Profile: CUDA time per kernel over a few decode steps at batch 1, and (`exposed_bs1`) the step's wall
time split by kernel where PDL overlaps them (metainfer/bench/critical_path.py).

    python benchmarks/decode_bench.py --dtype bfloat16 --out $OUT
    python benchmarks/decode_bench.py --dtype fp8 --batches 1,32 --out $OUT
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_smoke import env_info  # noqa: E402

from metainfer.bench.critical_path import (  # noqa: E402
    compact_timeline,
    device_intervals,
    exposed_table,
    launch_overhead,
    layer_floor_bytes,
    layer_table,
    print_layer_table,
)
from metainfer.bench.roofline import DEFAULT_BANDWIDTH_TB_S, decode_ceiling  # noqa: E402
from metainfer.config import FULL_CONFIG, SSM_STATE_DTYPES, ModelConfig  # noqa: E402
from metainfer.engine.request import SamplingParams  # noqa: E402
from metainfer.kernels import norm  # noqa: E402
from metainfer.kernels import weight_stream as ws  # noqa: E402
from metainfer.llm import LLM  # noqa: E402
from metainfer.settings import settings  # noqa: E402


def random_prompts(n: int, length: int, seed: int, vocab: int = 248000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def prompt_vocab(llm: LLM) -> int:
    """The prompts' token ids: below 248,000 (the full config's vocabulary), or a test model's smaller one."""
    return min(248000, llm.engine.model_config.vocab_size)


def decode_run(llm: LLM, batch: int, prompt_len: int, gen: int, seed: int) -> dict:
    eng = llm.engine
    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in random_prompts(batch, prompt_len, seed, prompt_vocab(llm))]
    steps, other, tokens, errors = [], 0.0, {}, []
    while eng.has_unfinished():
        decode_only = not eng.scheduler.waiting and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in eng.scheduler.running
        )
        n = len(eng.scheduler.running)
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        for o in outs:
            if o.finished:
                tokens[o.request_id] = o.token_ids
            if o.error:
                errors.append(o.error)
        if decode_only and n == batch:
            steps.append(dt)
        else:
            other += dt
    if not steps:
        raise RuntimeError(f"no decode step of {batch} sequences timed (errors: {errors[:3]})")
    steady = steps[3:] or steps
    med = statistics.median(steady)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "gen": gen,
        "steps": len(steps),
        "step_ms_median": med * 1e3,
        "step_ms_p90": sorted(steady)[int(0.9 * (len(steady) - 1))] * 1e3,
        "decode_tok_s": batch / med,
        "non_decode_s": other,
        # the greedy outputs' fingerprint (requests in order): two kernel paths that agree give the same
        "tokens_sha1": hashlib.sha1(json.dumps([tokens.get(i) for i in ids]).encode()).hexdigest()[:12],
        "errors": errors[:3],
    }


def ttft(llm: LLM, prompt_len: int, reps: int = 9, seed: int = 99) -> dict:
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i, p in enumerate(random_prompts(reps + 1, prompt_len, seed=seed)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=[p], sampling_params=sp)
        if i:  # first one warms up
            times.append(time.perf_counter() - t0)
    return {
        "prompt_len": prompt_len,
        "ttft_ms_median": statistics.median(times) * 1e3,
        "ttft_ms_min": min(times) * 1e3,
        "ttft_ms_all": [t * 1e3 for t in times],
    }


def graph_replay_ms(llm: LLM, batch: int = 1, reps: int = 50) -> float | None:
    """The batch's decode graph replayed back to back on its last staged inputs (no host work, no
    sampling, no input copies between replays): ms a replay, CUDA events; None without that graph.
    Against the engine's step it prices the work outside the graph. (It rewrites the last step's KV
    row and state slot in place: run it after every measurement.)"""
    dec = llm.engine.runner.decode
    g = dec.graphs.get(batch) if dec is not None and dec.use_graphs else None
    if g is None:
        return None
    for _ in range(5):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def profile_decode(llm: LLM, prompt_len: int, steps: int = 6,
                   batch: int = 1) -> tuple[list[dict], list[dict], dict]:
    """Kernel times per decode step of `batch` sequences (their prefills run before the profile; every
    sequence lives past the profiled steps, so the batch stays whole) -> (per kernel: its summed
    durations; per kernel: its exposed time, `critical_path.exposed_table`, the wall time's split
    when PDL overlaps the kernels; the profiled steps' intervals, `critical_path.compact_timeline`)."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    prefill_steps = -(-batch * prompt_len // eng.ecfg.max_num_batched_tokens)  # the first decode meanwhile
    params = SamplingParams(max_tokens=prefill_steps + steps + 8, temperature=0.0, ignore_eos=True)
    for p in random_prompts(batch, prompt_len, seed=7, vocab=prompt_vocab(llm)):
        eng.add_request(p, params)
    for _ in range(64):  # every prefill done and a few decode steps (chunked prefills take several)
        sch = eng.scheduler
        if not sch.waiting and all(len(r.output_token_ids) >= 3 for r in sch.running):
            break
        eng.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
    while eng.has_unfinished():
        eng.step()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append({"kernel": ev.key[:90], "calls_per_step": ev.count / steps, "us_per_step": t / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    try:  # the kernels' intervals must not cost the profile
        intervals = device_intervals(prof.events())
        exposed, timeline = exposed_table(intervals, steps), compact_timeline(intervals)
    except Exception as e:
        print(f"exposed times: {e!r}", file=sys.stderr)
        exposed, timeline = [], {}
    return rows, exposed, timeline


def profile_prefill(llm: LLM, prompt_len: int) -> dict:
    """One idle-engine prefill of a prompt_len-token prompt (max_tokens=1) under the profiler: wall
    time, the GPU time its kernels add up to, how many launches, the top kernels. Wall far above the
    kernels' sum means the prefill is bound by launching (Python, host syncs), not by the GPU."""
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(1, prompt_len, seed=123)[0]
    llm.generate(prompt_token_ids=[random_prompts(1, prompt_len, seed=124)[0]], sampling_params=sp)  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=sp)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append({"kernel": ev.key[:90], "calls": ev.count, "us": t})
    rows.sort(key=lambda r: -r["us"])
    launches = sum(r["calls"] for r in rows if not r["kernel"].startswith("Mem"))
    return {"prompt_len": prompt_len, "wall_ms": wall * 1e3, "kernel_ms": sum(r["us"] for r in rows) / 1e3,
            "launches": launches, "top": rows[:20]}


def kernel_floors(cfg: ModelConfig, fp8: bool, context: int, batch: int = 1,
                  state_bytes: int = 4) -> dict[str, tuple[str, float]]:
    """Bytes each kernel family must move per decode step of `batch` sequences (weights, state, KV
    cache; the activations are noise), keyed by a substring of the kernel name -> (what, bytes).
    Routed experts: the expected number of distinct ones, E (1 - (1 - k/E)^batch), plus the shared."""
    w = 1 if fp8 else 2  # bytes per weight of the quantised projections and experts
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    n_full = sum(t == "full_attention" for t in cfg.layer_types)
    n_lin = L - n_full
    conv = cfg.linear_conv_dim
    in_proj = (conv + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads) * H
    out_proj = cfg.linear_value_dim * H
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv, o_proj = (2 * hq + 2 * hkv) * d * H, hq * d * H
    router = (cfg.num_experts + 1) * H * 2  # BF16 in both precisions
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    slots = E * (1 - (1 - k / E) ** batch) + 1  # distinct routed experts + the shared expert
    I = cfg.moe_intermediate_size
    state = batch * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    state *= state_bytes
    kv = batch * context * hkv * d * 2 * 2  # K and V, bf16
    fused = batch <= norm.ROUTER_MAX_T  # the router in the post-attention norm's launch (else a projection)
    gnorm = batch <= ws.GNORM_MAX_T  # the DeltaNet out_proj with its gated norm (else a projection)
    wg = fp8 and batch == 1  # the qkv and the DeltaNet in_proj on cuda/gemv.cu
    return {
        "_skinny_kernel": ("dense projections" + ("" if fused else " + router"),
                           w * (n_lin * ((not wg) * in_proj + (not gnorm) * out_proj)
                                + n_full * ((not wg) * qkv + o_proj))
                           + (not fused) * L * router),
        "gemv_e4m3": ("FP8 wgmma projections: qkv" + (" + in_proj" if wg else ""),
                      w * (wg * n_full * qkv + wg * n_lin * in_proj)),
        "_add_rms_norm_router_kernel": ("add + RMSNorm + MoE router", L * router),
        "_gnorm_gemv_kernel": ("DeltaNet gated RMSNorm + out_proj", w * n_lin * out_proj),
        "_pair_gate_up_kernel": ("experts gate/up (routed + shared)", L * w * slots * 2 * I * H),
        "moe_gate_up_e4m3": ("experts gate/up (routed + shared) on gemv.cu", L * w * slots * 2 * I * H),
        "_grouped_gate_up_kernel": ("experts gate/up (routed + shared)", L * w * slots * 2 * I * H),
        "_pair_down": ("experts down", L * w * slots * H * I),
        "_routed_down_kernel": ("experts down", L * w * slots * H * I),
        "_grouped_down_kernel": ("experts down", L * w * slots * H * I),
        "nvjet": ("lm_head (BF16)", cfg.vocab_size * H * 2),
        "_gdn_decode_kernel": ("DeltaNet state read + write", n_lin * 2 * state),
        "_conv_update_kernel": ("conv state read + write",
                                batch * n_lin * 2 * (cfg.linear_conv_kernel_dim - 1) * conv * 2),
        "_decode_split_kernel": ("KV cache read", n_full * kv),
    }


def floor_table(profile: list[dict], floors: dict[str, tuple[str, float]], tb_s: float) -> list[dict]:
    """The profile's kernels with their byte floors (bytes / bandwidth) where they have one."""
    rows = []
    for r in profile:
        # "nvjet" is the lm_head only once a step: cuBLAS's dense projections of wider batches are
        # nvjet kernels too (tens a step, no floor of their own here)
        once = r["calls_per_step"] <= 1
        hit = max((k for k in floors if k in r["kernel"] and (k != "nvjet" or once)), key=len, default=None)
        what, nbytes = floors[hit] if hit else ("", 0.0)
        floor_us = nbytes / (tb_s * 1e6)
        rows.append(dict(r, what=what, bytes_per_step=nbytes, floor_us=floor_us,
                         pct_of_floor=100 * floor_us / r["us_per_step"] if nbytes else None))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(FULL_CONFIG))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "fp8"])
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--prefill-graphs", default="auto",
                    help="e.g. 1024: lone-prefill CUDA graphs (TTFT); auto: the engine default; 0: none")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile-batch", type=int, default=1, help="the decode profile's batch size")
    ap.add_argument("--sync-too", action="store_true", help="also time batch 1 with async scheduling off")
    ap.add_argument("--ssm-state-dtype", default="float32", choices=SSM_STATE_DTYPES,
                    help="storage of the DeltaNet recurrent states")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the engine's max_model_len (default: prompt + gen + 64). The decode attention's "
                         "split count follows the block-table capacity (the server's 8,192: 128 at batch 1)")
    ap.add_argument("--fp8-lm-head", action="store_true", help="with --dtype fp8: the lm_head in FP8 too")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    quant = "fp8" if args.dtype == "fp8" else None
    t0 = time.perf_counter()
    llm = LLM(
        model=f"dummy:{args.config}",
        device="cuda",
        dtype="bfloat16",
        quantization=quant,
        fp8_lm_head=bool(quant and args.fp8_lm_head),
        max_model_len=args.max_model_len or args.prompt_len + args.gen + 64,
        max_num_seqs=max(batches + [args.profile_batch]),
        max_num_batched_tokens=8192,
        enforce_eager=args.eager,
        ssm_state_dtype=args.ssm_state_dtype,
        prefill_graphs=None if args.prefill_graphs == "auto" else tuple(
            int(s) for s in args.prefill_graphs.split(",") if s and s != "0"),
    )
    init_s = time.perf_counter() - t0
    graphs = bool(llm.engine.runner.decode and llm.engine.runner.decode.graphs)
    print(
        f"engine init {init_s:.1f}s (warmup {llm.engine.runner.warmup_s:.1f}s, graphs: {graphs})",
        flush=True,
    )
    cfg = ModelConfig.from_hf(args.config)
    roof_dtype = "fp8" if quant else "bfloat16"
    # the ceiling's lm_head bytes: BF16 unless --fp8-lm-head quantised it
    head_dtype = "fp8" if quant and args.fp8_lm_head else None
    res = {
        "env": env_info(),
        "config": args.config,
        "dtype": args.dtype,
        "ssm_state_dtype": args.ssm_state_dtype,
        "init_s": init_s,
        "warmup_s": llm.engine.runner.warmup_s,
        "cuda_graphs": bool(llm.engine.runner.decode and llm.engine.runner.decode.graphs),
        "prefill_graphs": sorted(llm.engine.runner.prefill.graphs) if llm.engine.runner.prefill else [],
        "decode": [],
    }
    res["ttft_fresh"] = ttft(llm, args.prompt_len, seed=98)  # before any decode run
    print(json.dumps(res["ttft_fresh"]), flush=True)
    for b in batches:
        r = decode_run(llm, b, args.prompt_len, args.gen, seed=b)
        ceil = decode_ceiling(cfg, roof_dtype, concurrency=b, context=args.prompt_len + args.gen // 2,
                              state_bytes=2 if args.ssm_state_dtype == "bfloat16" else 4,
                              lm_head_dtype=head_dtype)
        r["ceiling_tok_s"] = ceil.tok_s
        r["pct_of_ceiling"] = 100 * r["decode_tok_s"] / ceil.tok_s
        res["decode"].append(r)
        print(json.dumps(r), flush=True)
    if args.sync_too:
        llm.engine.async_scheduling = False
        r = decode_run(llm, 1, args.prompt_len, args.gen, seed=1)
        llm.engine.async_scheduling = True
        res["decode_sync_bs1"] = r
        print("sync scheduling:", json.dumps(r), flush=True)
    res["ttft"] = ttft(llm, args.prompt_len)
    if llm.engine.runner.prefill is not None:  # steps served by the lone-prefill graphs (all TTFT reps)
        res["prefill_graph_runs"] = llm.engine.runner.prefill.runs
    print(json.dumps(res["ttft"]), flush=True)
    if not args.no_profile:
        try:
            res["prefill_profile"] = profile_prefill(llm, args.prompt_len)
        except Exception as e:  # profiling is optional
            res["prefill_profile_error"] = repr(e)
    if not args.no_profile:
        try:
            pb = args.profile_batch
            prof, exposed, timeline = profile_decode(llm, args.prompt_len, batch=pb)
            floors = kernel_floors(cfg, quant is not None, args.prompt_len + 8, batch=pb,
                                   state_bytes=2 if args.ssm_state_dtype == "bfloat16" else 4)
            res[f"profile_bs{pb}"] = floor_table(prof, floors, DEFAULT_BANDWIDTH_TB_S)
            res["profile_pdl"] = settings().pdl  # on: kernel times overlap
            res[f"exposed_bs{pb}"] = exposed
            res[f"timeline_bs{pb}"] = timeline  # the profiled steps' kernels, for offline study
            dec = next((r for r in res["decode"] if r["batch"] == pb), None)
            if dec is not None and exposed:  # the step past its byte floor, per launch
                res[f"launch_overhead_bs{pb}"] = launch_overhead(exposed, dec["step_ms_median"] * 1e3,
                                                                 1e6 * pb / dec["ceiling_tok_s"])
        except Exception as e:  # profiling is optional
            res["profile_error"] = repr(e)
    if 1 in batches:
        try:
            res["graph_replay_ms_bs1"] = graph_replay_ms(llm, 1)
        except Exception as e:  # optional
            res["graph_replay_error"] = repr(e)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decode_bench_{args.dtype}.json").write_text(json.dumps(res, indent=1))
    print(f"\n[{args.dtype}] | batch | step ms | tok/s | % ceiling |")
    for r in res["decode"]:
        print(
            f"| {r['batch']} | {r['step_ms_median']:.2f} | {r['decode_tok_s']:.0f} "
            f"| {r['pct_of_ceiling']:.0f}% |"
        )
    gr = res.get("graph_replay_ms_bs1")
    step1 = next((r["step_ms_median"] for r in res["decode"] if r["batch"] == 1), None)
    if gr and step1:
        print(f"bs1: the decode graph alone {gr:.3f} ms a replay; the engine's step {step1:.3f} ms "
              f"({1e3 * (step1 - gr):.0f} us outside the graph)")
    if "decode_sync_bs1" in res:
        print(f"bs1 with async scheduling off: {res['decode_sync_bs1']['decode_tok_s']:.0f} tok/s")
    if "prefill_graph_runs" in res:
        print(f"lone-prefill graph replays: {res['prefill_graph_runs']}")
    fresh = res["ttft_fresh"]
    print(f"TTFT 1k: {res['ttft']['ttft_ms_median']:.1f} ms (fresh engine: {fresh['ttft_ms_median']:.1f} ms,"
          f" min {fresh['ttft_ms_min']:.1f})")
    if "prefill_profile" in res:
        pp = res["prefill_profile"]
        print(f"prefill {pp['prompt_len']} tokens: wall {pp['wall_ms']:.1f} ms, "
              f"kernels {pp['kernel_ms']:.1f} ms over {pp['launches']} launches")
    prof_rows = res.get(f"profile_bs{args.profile_batch}", [])
    total = sum(r["us_per_step"] for r in prof_rows)
    pdl = "on: kernel times overlap" if res.get("profile_pdl") else "off"
    print(f"batch-{args.profile_batch} profile (PDL {pdl}), {total:.0f} us of kernels per step:")
    for row in prof_rows[:25]:
        floor = " " * 23
        if row["bytes_per_step"]:
            floor = f"floor {row['floor_us']:6.1f} us ({row['pct_of_floor']:3.0f}%)"
        print(f"  {row['us_per_step']:8.1f} us  x{row['calls_per_step']:<3.0f} {floor}  {row['kernel'][:60]}")
    exposed = res.get(f"exposed_bs{args.profile_batch}", [])
    if exposed:
        span = sum(r["exposed_us_per_step"] for r in exposed)
        print(f"the step's wall time by kernel (exposed: past every earlier kernel's end), {span:.0f} us"
              " a step:")
        for row in exposed[:16]:
            print(f"  {row['exposed_us_per_step']:8.1f} us exposed {row['busy_us_per_step']:8.1f} us busy"
                  f"  x{row['calls_per_step']:<3.0f} {row['kernel'][:60]}")
    lo = res.get(f"launch_overhead_bs{args.profile_batch}")
    if lo:
        print(f"batch {args.profile_batch}: {lo['launches']:.0f} kernel launches a step; the step is "
              f"{lo['over_floor_us']:.0f} us over its byte floor: {lo['us_per_launch']:.2f} us a launch")
    timeline = res.get(f"timeline_bs{args.profile_batch}")
    if timeline and args.profile_batch == 1:
        floors = layer_floor_bytes(cfg, quant is not None, args.prompt_len + args.gen // 2)
        print_layer_table(layer_table(timeline), floors, DEFAULT_BANDWIDTH_TB_S)


if __name__ == "__main__":
    main()
