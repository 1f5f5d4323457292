"""`metainfer verify`: exit codes 0 / 1 / 2, the printed table, the JSON verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from metainfer.cli import main
from metainfer.model.qwen3_5_moe import Qwen3_5MoeModel

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


def test_cli_passes_and_writes_verdict(tiny_config, tmp_path):
    out = tmp_path / "verdict.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "metainfer.cli",
            "verify",
            "--model",
            f"dummy:{tiny_config}",
            "--device",
            "cpu",
            "--suite",
            "quick",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verdict: PASS" in r.stdout and "prefill.kl_mean" in r.stdout
    v = json.loads(out.read_text())
    assert v["passed"] is True and v["precision"] == "float32"
    assert v["env"]["torch"] and v["env"]["transformers"] and v["env"]["date_utc"]
    assert v["reference"]["implementation"] == "transformers.Qwen3_5MoeForCausalLM"
    assert v["engine"]["max_num_batched_tokens"] == v["suite"]["chunk_tokens"]
    assert v["gates"]["precision"] == "float32"


def test_cli_fails_a_wrong_engine(tiny_config, monkeypatch, capsys):
    original = Qwen3_5MoeModel.lm_logits  # (under compute_logits and the decode graph's argmax)

    def biased(self, hidden):
        out = original(self, hidden).float()
        out[:, 3] += 1.0
        return out

    monkeypatch.setattr(Qwen3_5MoeModel, "lm_logits", biased)
    assert main(["verify", "--model", f"dummy:{tiny_config}", "--device", "cpu", "--suite", "quick"]) == 1
    assert "verdict: FAIL" in capsys.readouterr().out


def test_cli_usage_errors(tmp_path, capsys):
    assert main(["verify", "--model", str(tmp_path / "nowhere"), "--device", "cpu"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["verify", "--model", "dummy:x.json", "--dtype", "float16", "--device", "cpu"]) == 2
    try:
        main(["verify", "--suite", "huge"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("argparse accepted a bad --suite")


def test_cli_reports_the_speculative_verifies(capsys):
    """With speculation the table is followed by what the verify path was judged on (default model,
    MTP drafts)."""
    args = ["verify", "--device", "cpu", "--suite", "quick", "--speculative", "mtp"]
    args += ["--speculative-max-seqs", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("speculative: "))
    assert line.endswith("(mtp)") and " of " in line and " over " in line
