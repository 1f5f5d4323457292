"""benchmarks/draft_vocab_coverage.py: the share of a text's Qwen3.6 tokens whose ids lie below N."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_coverage_counts_the_ids_below_n(tmp_path):
    from metainfer.tokenizer import QwenTiktokenTokenizer

    text = "def main():\n    print('hello world')\n\n# 你好，世界 — ünïcödé\n" * 3
    (tmp_path / "t.txt").write_text(text)
    ids = QwenTiktokenTokenizer().encode(text)
    cut = sorted(ids)[len(ids) // 2]  # an N with some ids below and some not
    cmd = [sys.executable, str(ROOT / "benchmarks" / "draft_vocab_coverage.py"), "--n", f"{cut},300000",
           "--files", str(tmp_path / "t.txt"), "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    c = json.loads((tmp_path / "draft_vocab_coverage.json").read_text())["corpora"]["files"]
    assert c["tokens"] == len(ids)
    assert c["below"][str(cut)] == sum(i < cut for i in ids) / len(ids)
    assert 0 < c["below"][str(cut)] < 1 and c["below"]["300000"] == 1.0
