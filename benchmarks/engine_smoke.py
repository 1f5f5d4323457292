"""GPU smoke + eager baseline: the full Qwen3.6-35B-A3B config with dummy BF16 weights.

1. builds the engine (dummy weights on the device) and transformers' reference on the same
   tensors (views, no copy); compares teacher-forced logits on a few prompts;
2. times eager decode at batch 1 and batch 32 (1k-token prompts, greedy, ignore_eos).

    python benchmarks/engine_smoke.py --out $OUT                  # H200, full config
    python benchmarks/engine_smoke.py --config metainfer/assets/stdlib/config.json --device cpu \\
        --dtype float32 --lengths 5,40 --batches 1,2 --prompt-len 32 --gen 4 --out /tmp/smoke   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from metainfer.config import FULL_CONFIG
from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM


def build_reference(llm: LLM):
    """transformers' Qwen3_5MoeForCausalLM whose parameters are views of the engine's weights."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from metainfer.model.weights import hf_state_dict

    model = llm.engine.runner.model
    d = model.cfg.to_hf_text_dict()
    d.pop("architectures", None)
    cfg = Qwen3_5MoeTextConfig(**d)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = Qwen3_5MoeForCausalLM(cfg)
    sd = hf_state_dict(model)
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=True)
    assert not unexpected, unexpected[:5]
    dev = model.embed_tokens.weight.device
    rot = hf.model.rotary_emb
    inv = rot.compute_default_rope_parameters(cfg, device=dev)[0]
    rot.inv_freq = inv
    rot.original_inv_freq = inv.clone()
    left = [n for n, p in list(hf.named_parameters()) + list(hf.named_buffers()) if p.is_meta]
    assert not left, left[:5]
    return hf.eval()


def rel_rmse(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@torch.inference_mode()
def compare_logits(llm: LLM, hf, lengths: list[int], seed: int) -> list[dict]:
    V = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, min(V, 248000), (n,), generator=g).tolist() for n in lengths]
    got = llm.score(prompts)
    rows = []
    dev = llm.engine.runner.device
    for p, e in zip(prompts, got):
        ref = hf(torch.tensor([p], device=dev)).logits[0].float()
        pr = ref.softmax(-1)
        lp_ref, lp_eng = ref.log_softmax(-1), e.log_softmax(-1)
        kl = (pr * (lp_ref - lp_eng)).sum(-1)
        top2 = ref.topk(2, -1).values
        rows.append(
            {
                "prompt_len": len(p),
                "rel_rmse": rel_rmse(e, ref),
                "kl_mean": float(kl.mean()),
                "kl_max": float(kl.max()),
                "top1_agree": float((e.argmax(-1) == ref.argmax(-1)).float().mean()),
                "ref_entropy": float(-(pr * lp_ref).sum(-1).mean()),
                "ref_top1_prob": float(pr.max(-1).values.mean()),
                "ref_top1_logit_margin": float((top2[:, 0] - top2[:, 1]).mean()),
            }
        )
    return rows


def time_decode(llm: LLM, batch: int, prompt_len: int, gen: int, seed: int) -> dict:
    """Runs `batch` prompts together; times the steps where every sequence decodes."""
    eng = llm.engine
    V = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(torch.randint(0, min(V, 248000), (prompt_len,), generator=g).tolist(), sp)
    step_times, prefill_time = [], 0.0
    while eng.has_unfinished():
        decode_only = not eng.scheduler.waiting and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in eng.scheduler.running
        )
        t0 = time.perf_counter()
        eng.step()  # returns after the sampled tokens reached the host
        dt = time.perf_counter() - t0
        if decode_only and len(eng.scheduler.running) in (batch, 0):
            step_times.append(dt)
        else:
            prefill_time += dt
    steady = sorted(step_times[2:]) or sorted(step_times)
    med = steady[len(steady) // 2]
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "gen": gen,
        "decode_steps": len(step_times),
        "step_ms_median": med * 1e3,
        "decode_tok_s": batch / med,
        "prefill_s": prefill_time,
    }


def env_info() -> dict:
    from metainfer.runinfo import git, package_version

    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "HEAD"),
        "transformers": package_version("transformers"),
        "triton": package_version("triton"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(FULL_CONFIG))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--lengths", default="5,100,1000")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=24)
    ap.add_argument("--kernels", action="store_true")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = {"env": env_info(), "config": args.config, "dtype": args.dtype, "kernels": args.kernels}
    t0 = time.perf_counter()
    llm = LLM(
        model=f"dummy:{args.config}",
        device=args.device,
        dtype=args.dtype,
        max_model_len=4096,
        max_num_seqs=64,
        num_kv_blocks=4096,
        max_num_batched_tokens=4096,
    )
    if args.device == "cuda":
        torch.cuda.synchronize()
    result["engine_init_s"] = time.perf_counter() - t0
    print(f"engine init {result['engine_init_s']:.1f}s", flush=True)
    if args.kernels:
        from metainfer.kernels import ops

        ops.use_kernels(True)
    try:
        hf = build_reference(llm)
        result["logits"] = compare_logits(llm, hf, [int(x) for x in args.lengths.split(",")], seed=0)
        del hf
    except Exception:  # keep the timing part of the run
        import traceback

        traceback.print_exc()
        result["logits"] = []
    for r in result["logits"]:
        print(json.dumps(r), flush=True)
    result["decode"] = [
        time_decode(llm, b, args.prompt_len, args.gen, seed=b) for b in map(int, args.batches.split(","))
    ]
    (Path(args.out) / "engine_smoke.json").write_text(json.dumps(result, indent=1))
    print("\n| prompt | rel RMSE | KL mean | top-1 agree | ref entropy | ref top-1 p |")
    print("|---|---|---|---|---|---|")
    for r in result["logits"]:
        print(
            f"| {r['prompt_len']} | {r['rel_rmse']:.2e} | {r['kl_mean']:.2e} | {r['top1_agree']:.3f} | "
            f"{r['ref_entropy']:.2f} | {r['ref_top1_prob']:.2f} |"
        )
    print("\n| batch | step ms | decode tok/s | prefill s |")
    print("|---|---|---|---|")
    for d in result["decode"]:
        print(
            f"| {d['batch']} | {d['step_ms_median']:.1f} | {d['decode_tok_s']:.1f} | {d['prefill_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
