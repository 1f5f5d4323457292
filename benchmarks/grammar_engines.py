"""llguidance vs xgrammar on this host's CPU: grammar compile time for a typical JSON schema and the
per-token mask fill, for a tokenizer (default: the embedded default model's; `--qwen`: Qwen3.6's
248k ids). xgrammar is optional (not a dependency): its numbers are printed where it imports.

    python benchmarks/grammar_engines.py [--qwen] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from metainfer.engine.grammar import GrammarBackend, StructuredSpec, _TokenTable, bitmask_words, grammar_text
from metainfer.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "poetry"],
                  "address": {"city": "London", "zip": "W1"}, "role": "admin"}, separators=(",", ":"))


def ms(f, n=1):
    t = time.perf_counter()
    for _ in range(n):
        r = f()
    return (time.perf_counter() - t) * 1e3 / n, r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qwen", action="store_true")
    args = ap.parse_args()
    tok = load_tokenizer(None if args.qwen else "metainfer/assets/stdlib")
    V = 248320 if args.qwen else 4096
    eos = list(tok.eos_token_ids)
    ids = tok.encode(DOC)
    print(f"tokenizer {tok.name}: {V} ids, document {len(ids)} tokens")
    t_table, table = ms(lambda: _TokenTable(tok, V, eos))
    print(f"token table (shared by both): {t_table:.0f} ms")

    t_init, be = ms(lambda: GrammarBackend(tok, V, eos))
    spec = StructuredSpec.json_schema(SCHEMA)
    t_comp, _ = ms(lambda: be._ll.LLMatcher(be.tokenizer, grammar_text(spec), log_level=0))
    bm = torch.zeros(1, bitmask_words(V), dtype=torch.int32)
    m = be.matcher(spec)
    fills = []
    for _ in ids:
        t0 = time.perf_counter()
        m.fill(bm, 0)
        fills.append(time.perf_counter() - t0)
        m.sync(ids[: m.fed + 1])
    assert not m.error, m.error
    fills.sort()
    print(f"llguidance: tokenizer init {t_init:.0f} ms, schema compile {t_comp:.2f} ms, mask fill per token "
          f"mean {sum(fills) / len(fills) * 1e3:.3f} ms, p50 {fills[len(fills) // 2] * 1e3:.3f} ms, "
          f"max {fills[-1] * 1e3:.3f} ms")

    try:
        import xgrammar as xgr
    except ImportError as e:
        print(f"xgrammar: not importable ({e})")
        return
    t_init, info = ms(lambda: xgr.TokenizerInfo(table.tokens, vocab_type=xgr.VocabType.RAW,
                                                vocab_size=V, stop_token_ids=eos))
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    t_comp, cg = ms(lambda: comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                     separators=(",", ":")))
    mt = xgr.GrammarMatcher(cg)
    bm = xgr.allocate_token_bitmask(1, V)
    fills = []
    for t in ids:
        t0 = time.perf_counter()
        mt.fill_next_token_bitmask(bm, 0)
        fills.append(time.perf_counter() - t0)
        assert mt.accept_token(t), t
    fills.sort()
    print(f"xgrammar: tokenizer init {t_init:.0f} ms, schema compile {t_comp:.2f} ms, mask fill per token "
          f"mean {sum(fills) / len(fills) * 1e3:.3f} ms, p50 {fills[len(fills) // 2] * 1e3:.3f} ms, "
          f"max {fills[-1] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
