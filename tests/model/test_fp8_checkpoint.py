"""The published FP8 checkpoint layout: written from the dummy weights (metainfer.model.export),
loaded back as e4m3 storage bit-identical to online quantisation, and malformed checkpoints refused
with one clear error each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from metainfer.model.quant_config import CheckpointError
from tests.helpers import rel_rmse, write_config

# 128-aligned stacked parts like the real model (q/k/v, qkv/z, gate/up): the checkpoint's own blocks
# are the engine's, so loading is a copy
ALIGNED = dict(hidden_size=128, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32,
               moe_intermediate_size=128, shared_expert_intermediate_size=128, mtp_num_hidden_layers=1,
               num_hidden_layers=4)
SHARD = 1_000_000  # bytes: several shards at this size


def _write(cfg: Path, out: Path, fmt: str = "fp8", **kw) -> list[Path]:
    from metainfer.model.export import dummy_model, write_checkpoint

    model = dummy_model(cfg, seed=3, device="cpu", dtype=torch.float32)
    return write_checkpoint(model, cfg, out, fmt, shard_bytes=SHARD, progress=False, **kw)


@pytest.fixture(scope="module")
def aligned(tmp_path_factory) -> tuple[Path, Path]:
    """(the dummy model's config.json, an FP8 checkpoint written from its seed-3 weights)."""
    root = tmp_path_factory.mktemp("fp8_ckpt")
    cfg = write_config(root / "src", **ALIGNED)
    _write(cfg, root / "fp8")
    return cfg, root / "fp8"


def _llm(model: str, **kw):
    from metainfer.llm import LLM

    return LLM(model=model, device="cpu", dtype="float32", progress=False, **kw)


def _engine_tensors(llm) -> dict[str, torch.Tensor]:
    """Every parameter of the engine, and every FP8 scale."""
    from metainfer.model.fp8 import fp8_linears, fp8_moes

    m = llm.engine.runner.model
    out = dict(m.named_parameters())
    for name, lin in fp8_linears(m):
        out[f"{name}.weight_scale_inv"] = lin.weight_scale_inv
    for i, moe in enumerate(fp8_moes(m)):
        out[f"moe{i}.w_gate_up_scale"], out[f"moe{i}.w_down_scale"] = moe.w_gate_up_scale, moe.w_down_scale
    return {k: v for k, v in out.items() if v is not None}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(_bits(a[k]), _bits(b[k]))]
    assert not bad, bad


def test_layout_is_the_published_one(aligned):
    cfg, ck = aligned
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in ck.glob("*.safetensors"))
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    keys = {}
    for s in shards:
        with safe_open(str(ck / s), framework="pt") as f:
            keys.update({k: f.get_slice(k) for k in f.keys()})
    assert keys.keys() == index["weight_map"].keys()
    p = "model.language_model.layers"
    e4m3 = {k for k, v in keys.items() if v.get_dtype() == "F8_E4M3"}
    assert f"{p}.0.mlp.experts.7.up_proj.weight" in e4m3 and f"{p}.3.self_attn.k_proj.weight" in e4m3
    assert f"{p}.0.mlp.experts.gate_up_proj" not in keys  # per expert, not fused
    assert keys[f"{p}.0.mlp.experts.7.down_proj.weight_scale_inv"].get_shape() == [1, 1]
    assert keys[f"{p}.3.self_attn.q_proj.weight_scale_inv"].get_shape() == [4, 1]  # [512, 128] weight
    assert all(keys[k + "_scale_inv"].get_dtype() == "F32" for k in e4m3)
    for bf16 in ("0.linear_attn.in_proj_a.weight", "0.linear_attn.in_proj_b.weight", "0.mlp.gate.weight",
                 "0.mlp.shared_expert_gate.weight", "0.linear_attn.conv1d.weight"):
        assert f"{p}.{bf16}" not in e4m3 and f"{p}.{bf16}_scale_inv" not in keys
    assert "lm_head.weight" not in e4m3 and "mtp.fc.weight" not in e4m3
    assert "mtp.layers.0.self_attn.o_proj.weight" in e4m3
    qc = json.loads((ck / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["fmt"], qc["activation_scheme"], qc["weight_block_size"]) == (
        "fp8", "e4m3", "dynamic", [128, 128])
    kept = set(qc["modules_to_not_convert"])
    assert {"lm_head", "mtp.fc", f"{p}.0.linear_attn.in_proj_b", f"{p}.1.mlp.gate"} <= kept


def test_loads_as_fp8_bit_identical_to_online_quantisation(aligned):
    """No --quantization: the FP8 checkpoint gives an FP8 engine whose every tensor (e4m3 weights,
    fp32 scales, unquantised parameters) equals the engine quantising the same weights online;
    --quantization fp8 gives the same."""
    cfg, ck = aligned
    online = _engine_tensors(_llm(f"dummy:{cfg}", quantization="fp8", seed=3))
    loaded = _llm(str(ck))
    assert loaded.engine.runner.quantization == "fp8"
    got = _engine_tensors(loaded)
    assert got["layers.0.mlp.w_gate_up"].dtype == torch.float8_e4m3fn
    assert got["lm_head.weight"].dtype == torch.float32  # kept unquantised, as published
    _assert_identical(got, online)
    _assert_identical(_engine_tensors(_llm(str(ck), quantization="fp8")), online)


def test_bf16_scales_widen_exactly(aligned, tmp_path):
    """Scales stored in BF16 (as Qwen's releases store them) are widened to float32 exactly; the e4m3
    bytes are the checkpoint's."""
    cfg, _ = aligned
    _write(cfg, tmp_path, scale_dtype=torch.bfloat16)
    ck = {}
    for f in tmp_path.glob("*.safetensors"):
        ck.update(load_file(str(f)))
    m = _llm(str(tmp_path)).engine.runner.model
    p = "model.language_model.layers.3.self_attn"
    q = m.layers[3].self_attn.qkv_proj
    n = ck[f"{p}.q_proj.weight"].shape[0]
    assert ck[f"{p}.q_proj.weight_scale_inv"].dtype == torch.bfloat16
    assert torch.equal(q.weight[:n].view(torch.uint8), ck[f"{p}.q_proj.weight"].view(torch.uint8))
    assert torch.equal(q.weight_scale_inv[: n // 128], ck[f"{p}.q_proj.weight_scale_inv"].float())


def test_bf16_layout_roundtrip(aligned, tmp_path):
    """The BF16 release's layout (fused experts) loads back bit for bit as an unquantised engine."""
    cfg, _ = aligned
    _write(cfg, tmp_path, fmt="bf16")
    loaded = _llm(str(tmp_path))
    assert loaded.engine.runner.quantization is None
    _assert_identical(_engine_tensors(loaded), _engine_tensors(_llm(f"dummy:{cfg}", seed=3)))


def test_unaligned_parts_are_requantised_per_engine_block(tmp_path):
    """The tiny config's k/v rows do not start on a 128-row block of the stacked qkv: the loader
    dequantises them and quantises the engine's block; the result stays within FP8's error."""
    cfg = write_config(tmp_path / "src")
    _write(cfg, tmp_path / "fp8")
    got = _llm(str(tmp_path / "fp8"))
    want = _llm(f"dummy:{cfg}", seed=3)
    prompts = [[5, 17, 300, 2, 9, 44], [1, 2, 3]]
    for a, b in zip(got.score(prompts), want.score(prompts)):
        assert rel_rmse(a, b) < 0.05


def _edit(ck: Path, out: Path, fn) -> Path:
    """A copy of checkpoint `ck` with every shard's tensors passed through fn(dict) -> dict."""
    shutil.copytree(ck, out)
    for f in out.glob("*.safetensors"):
        save_file(fn(load_file(str(f))), str(f), metadata={"format": "pt"})
    return out


def _config_edit(ck: Path, out: Path, **qc) -> Path:
    shutil.copytree(ck, out)
    c = json.loads((out / "config.json").read_text())
    c["quantization_config"].update(qc)
    (out / "config.json").write_text(json.dumps(c))
    return out


K = "model.language_model.layers.3.self_attn.o_proj.weight"


def _drop_scale(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != K + "_scale_inv"}


def _bad_scale(d: dict) -> dict:
    return {**d, K + "_scale_inv": torch.ones(2, 3)} if K + "_scale_inv" in d else d


@pytest.mark.parametrize(
    "case, make, says",
    [
        ("missing scale", lambda ck, out: _edit(ck, out, _drop_scale), "o_proj (weight_scale_inv)"),
        ("scale shape", lambda ck, out: _edit(ck, out, _bad_scale), "shape (2, 3) != expected (1, 2)"),
        ("block size", lambda ck, out: _config_edit(ck, out, weight_block_size=[64, 64]), "[64, 64] is not"),
        ("static", lambda ck, out: _config_edit(ck, out, activation_scheme="static"), "'static' is not"),
        ("format", lambda ck, out: _config_edit(ck, out, fmt="e5m2"), "unsupported fmt 'e5m2'"),
        ("method", lambda ck, out: _config_edit(ck, out, quant_method="awq"), "quant_method 'awq'"),
        ("e4m3 kept", lambda ck, out: _config_edit(ck, out, modules_to_not_convert=["lm_head", "o_proj"]),
         "lists model.layers.3.self_attn.o_proj in modules_to_not_convert"),
    ],
)
def test_malformed_checkpoints_fail_with_one_clear_error(aligned, tmp_path, case, make, says):
    _, ck = aligned
    bad = make(ck, tmp_path / "bad")
    with pytest.raises(CheckpointError) as e:
        _llm(str(bad))
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_bf16_request_for_an_fp8_checkpoint_is_an_error(aligned, capsys):
    from metainfer.cli import main

    _, ck = aligned
    with pytest.raises(CheckpointError, match="is an FP8 checkpoint"):
        _llm(str(ck), quantization="none")
    rc = main(["generate", "--model", str(ck), "--device", "cpu", "--quantization", "none", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "FP8 checkpoint" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
