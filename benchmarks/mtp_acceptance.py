"""How often MTP drafts are accepted (`--speculative mtp`), per K, against plain greedy decoding.

On the embedded default model (its MTP head is trained) this is a real acceptance figure on text; on
dummy weights it is noise. Prompts: the first lines of the default model's sample snippets below, or
`--prompts FILE` (one prompt per line, `\\n` escapes). Each prompt is generated alone (a verify alone
in its step, synchronous scheduling), plain first; every speculative run must reproduce plain's
tokens. Reports per K: verifies, drafts, accepted, acceptance (accepted / drafted), and tokens per
verify step (1 + accepted / verifies).

    python benchmarks/mtp_acceptance.py --k 1,2,3,4 --gen 64 --out out/mtp_acceptance
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_smoke import env_info  # noqa: E402

from metainfer.engine.request import SamplingParams  # noqa: E402
from metainfer.llm import LLM  # noqa: E402

SNIPPETS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Parser(object):\n    def __init__(self",
    "    def __repr__(self):\n        return",
    "import re\n\n_pattern = re.compile(",
    "def read_file(path):\n    with open(path",
    "for i in range(len(items)):\n    if items[i]",
    "try:\n    import threading\nexcept ImportError:",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="model dir or dummy:<config> (default: the embedded model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--k", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 3, 4])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--prompts", default=None, help="file: one prompt per line (\\n escapes)")
    ap.add_argument("--out", default="out/mtp_acceptance")
    args = ap.parse_args()
    texts = SNIPPETS
    if args.prompts:
        texts = [ln.replace("\\n", "\n") for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
    kw = dict(model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
              async_scheduling=False)
    sp = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True, detokenize=False)
    plain = LLM(**kw)
    prompts = [plain.engine.tokenizer.encode(t) for t in texts]
    want = [plain.generate(prompt_token_ids=[p], sampling_params=sp)[0].token_ids for p in prompts]
    del plain
    res = {"env": env_info(), "model": args.model or "default", "gen": args.gen, "prompts": texts, "k": {}}
    for k in args.k:
        llm = LLM(**kw, speculative="mtp", num_speculative_tokens=k)
        tot = dict(verifies=0, drafted=0, accepted=0, equal=0)
        for p, w in zip(prompts, want):
            before = dict(llm.engine.stats)
            got = llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].token_ids
            st = llm.engine.stats
            tot["verifies"] += st["spec_verifies"] - before["spec_verifies"]
            tot["drafted"] += st["spec_drafted"] - before["spec_drafted"]
            tot["accepted"] += st["spec_accepted"] - before["spec_accepted"]
            tot["equal"] += got == w
        tot["acceptance"] = tot["accepted"] / max(tot["drafted"], 1)
        tot["tokens_per_verify"] = 1 + tot["accepted"] / max(tot["verifies"], 1)
        res["k"][k] = tot
        del llm
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mtp_acceptance.json").write_text(json.dumps(res, indent=1))
    print("| K | verifies | drafted | accepted | acceptance | tokens / verify | outputs == plain |")
    for k, t in res["k"].items():
        print(f"| {k} | {t['verifies']} | {t['drafted']} | {t['accepted']} | {t['acceptance']:.3f} | "
              f"{t['tokens_per_verify']:.2f} | {t['equal']} of {len(prompts)} |")


if __name__ == "__main__":
    main()
