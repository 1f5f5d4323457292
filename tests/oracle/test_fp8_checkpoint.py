"""`metainfer verify` on an FP8 checkpoint: the reference built from the checkpoint's dequantised
weights (read by the oracle), the engine's e4m3 bytes compared with the checkpoint's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
ALIGNED = dict(hidden_size=128, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32,
               moe_intermediate_size=128, shared_expert_intermediate_size=128, mtp_num_hidden_layers=1,
               num_hidden_layers=4)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    from metainfer.model.export import dummy_model, write_checkpoint
    from tests.helpers import write_config

    root = tmp_path_factory.mktemp("oracle_fp8_ckpt")
    cfg = write_config(root / "src", **ALIGNED)
    write_checkpoint(dummy_model(cfg, 0, "cpu", torch.float32), cfg, root / "fp8", "fp8",
                     shard_bytes=1_000_000, scale_dtype=torch.bfloat16, progress=False)
    return root / "fp8"


def test_verify_passes_on_the_dequantised_checkpoint(fp8_checkpoint, tmp_path):
    out = tmp_path / "verdict.json"
    r = subprocess.run(
        [sys.executable, "-m", "metainfer.cli", "verify", "--model", str(fp8_checkpoint), "--device", "cpu",
         "--suite", "quick", "--json", str(out)],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    v = json.loads(out.read_text())
    assert v["precision"] == "fp8" and v["engine"]["resolved_quantization"] == "fp8"
    assert v["reference"]["weights"] == "checkpoint-dequantised" and v["weights"]["mode"] == "fp8-checkpoint"
    assert any("dequantised FP8 checkpoint" in n for n in v["notes"])


def test_engine_bytes_other_than_the_checkpoints_fail_the_weights_check(fp8_checkpoint, monkeypatch):
    import metainfer.model.fp8 as fp8
    from metainfer.oracle.build import build_setup

    original = fp8.Fp8CheckpointLoader.finish

    def flip(self):  # one byte of one expert changed after the copy
        original(self)
        w = self.dests["model.layers.1.mlp.experts.gate_up_proj"].weight
        w.view(torch.uint8)[0, 0, 0] ^= 1

    monkeypatch.setattr(fp8.Fp8CheckpointLoader, "finish", flip)
    setup = build_setup(str(fp8_checkpoint), "quick", {"device": "cpu"})
    (check,), figures = setup.weights.check()
    assert not check.passed and figures["mismatched"] == ["model.layers.1.mlp.experts.gate_up_proj"]
