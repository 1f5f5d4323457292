"""Independent weights: the recipe restated by the oracle, tensor digests, and the weights audit.

Mutants change engine weights (in place after the build, or by another seed) and must fail
`weights.identical`; each prints its margin (how many tensors differ).
"""

from __future__ import annotations

import pytest
import torch

import metainfer.oracle.build as build
import metainfer.oracle.digest as digest
from metainfer.oracle.build import build_setup, fp8_available
from metainfer.oracle.digest import tensor_digest
from metainfer.oracle.recipe import recipe_spec, regenerate

pytest.importorskip("transformers")


def _engine_views(setup) -> dict[str, torch.Tensor]:
    from metainfer.model.weights import hf_state_dict

    return hf_state_dict(setup.llm.engine.runner.model)


def _judge(setup, label: str) -> tuple[bool, dict]:
    checks, figures = setup.weights.check()
    (c,) = checks
    assert c.name == "weights.identical" and c.gate == "== 0 tensors differ"
    print(f"{label}: {c.figure:g} of {figures['n_tensors']} tensors differ ({c.detail})")
    return c.passed, figures


@pytest.fixture
def fresh_digest_cache():
    digest._A.clear()
    yield
    digest._A.clear()


# ---- tensor_digest ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.int64]
)
def test_digest_sees_every_bit(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(37, 29, generator=g) * 50).to(dtype)
    d = tensor_digest(t)
    assert d == tensor_digest(t.clone())
    bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    for _ in range(5):
        i = int(torch.randint(t.numel(), (1,), generator=g))
        b = int(torch.randint(8 * t.element_size(), (1,), generator=g))
        flipped = bits.clone().reshape(-1)
        x = 1 << b
        if b == 8 * t.element_size() - 1 and bits.dtype != torch.uint8:
            x = -x  # the sign bit of a signed view
        flipped[i] ^= x
        assert tensor_digest(flipped.view(dtype).view(t.shape)) != d, (i, b)


def test_digest_covers_dtype_shape_and_order():
    t = torch.arange(24, dtype=torch.float32)
    assert tensor_digest(t) != tensor_digest(t.view(torch.int32))  # same bits, other dtype
    assert tensor_digest(t) != tensor_digest(t.view(4, 6))
    assert tensor_digest(t.view(4, 6)) != tensor_digest(t.view(6, 4))
    assert tensor_digest(t) != tensor_digest(t.flip(0))  # same values, other order
    assert tensor_digest(torch.tensor(1.0)) != tensor_digest(torch.tensor([1.0]))


def test_digest_of_views_is_layout_free(monkeypatch, fresh_digest_cache):
    """Non-contiguous views hash like their contiguous copies, whatever the chunking, also across
    the multiplier table's period (BLOCK made small here)."""
    monkeypatch.setattr(digest, "BLOCK", 64)
    t = torch.randn(3, 50, 40).bfloat16()
    views = [t.transpose(1, 2), t[:, ::3], t[1:, 7:31, 5], t.permute(2, 0, 1)[::2]]
    for v in views:
        assert not v.is_contiguous()
        want = tensor_digest(v.contiguous())
        assert tensor_digest(v) == want
        assert tensor_digest(v, chunk=17) == want  # rows wider than a chunk: split row by row
    assert tensor_digest(t, chunk=33) == tensor_digest(t)
    u = t.clone()
    u.view(-1)[1000] = u.view(-1)[1000] + 1  # well past the first period
    assert tensor_digest(u) != tensor_digest(t)


# ---- the recipe ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tied", [(torch.float32, False), (torch.bfloat16, True)])
def test_recipe_is_bit_identical_to_engine_init(tmp_path, dtype, tied):
    from metainfer.config import ModelConfig
    from metainfer.model.weights import build_model, hf_state_dict, init_dummy
    from tests.helpers import write_config

    cfg = write_config(tmp_path, tie_word_embeddings=tied)
    eng = build_model(ModelConfig.from_hf(cfg), dtype, "cpu")
    init_dummy(eng, 5)
    sd = hf_state_dict(eng)
    spec = recipe_spec(cfg)
    assert set(spec.shapes) | ({"lm_head.weight"} if tied else set()) == set(sd)
    for name in spec.shapes:
        r = regenerate(spec, name, 5, "cpu", dtype)
        assert r.dtype == sd[name].dtype and r.shape == sd[name].shape, name
        assert tensor_digest(r) == tensor_digest(sd[name]), name
        iv = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(r.view(iv), sd[name].view(iv)), name  # bit for bit
    assert tensor_digest(regenerate(spec, "model.norm.weight", 6, "cpu", dtype)) != tensor_digest(
        sd["model.norm.weight"]
    )


# ---- the audit: dummy models -----------------------------------------------------------------------
def test_honest_engine_independent(tiny):
    w = tiny.weights
    assert w.mode == "independent" and w.seed == 0 and tiny.reference.info.weights == "recipe"
    assert tiny.context("x")["weights"] == {
        "mode": "independent",
        "seed": 0,
        "source": "recipe",
        "n_tensors": w.describe()["n_tensors"],
    }
    eng, ref = _engine_views(tiny), tiny.reference.tensors()
    assert set(eng) == set(ref)
    shared = {n for n in eng if eng[n].untyped_storage().data_ptr() == ref[n].untyped_storage().data_ptr()}
    assert not shared, sorted(shared)[:3]  # the reference holds its own copy
    passed, fig = _judge(tiny, "honest")
    assert passed and fig["mismatched"] == [] and fig["bytes_hashed"] > 0


@pytest.mark.parametrize(
    "name,where",
    [
        ("model.layers.1.mlp.experts.down_proj", (3, slice(0, 8))),  # one expert's rows x1.05
        ("model.layers.2.input_layernorm.weight", None),  # +0.01
    ],
)
def test_weight_changed_in_place_fails(tiny, name, where):
    view = _engine_views(tiny)[name]
    saved = view.clone()
    try:
        if where is None:
            view += 0.01
        else:
            view[where] *= 1.05
        passed, fig = _judge(tiny, f"{name} changed")
        assert not passed and fig["mismatched"] == [name]
        assert fig["mismatched_by"] == {"engine": [name]}
    finally:
        view.copy_(saved)
    assert _judge(tiny, "restored")[0]


def test_engine_with_another_seed_fails(tiny_config, monkeypatch):
    import metainfer.engine.runner as runner

    original = runner.init_dummy
    monkeypatch.setattr(runner, "init_dummy", lambda model, seed: original(model, seed + 1))
    setup = build_setup(f"dummy:{tiny_config}", "quick", {"device": "cpu", "seed": 2})
    assert setup.weights.seed == 2
    passed, fig = _judge(setup, "seed 3 instead of 2")
    assert not passed and len(fig["mismatched"]) == fig["n_tensors"]


def test_shared_digest_fallback(tiny_config, monkeypatch):
    """No room for a second copy: the reference runs on the engine's tensors, checked by digest."""
    monkeypatch.setattr(build, "_fits", lambda nbytes, device: False)
    setup = build_setup(f"dummy:{tiny_config}", "quick", {"device": "cpu"})
    assert setup.weights.mode == "shared-digest" and setup.reference.info.weights == "shared"
    eng, ref = _engine_views(setup), setup.reference.tensors()
    name = "model.layers.0.linear_attn.out_proj.weight"
    assert ref[name].data_ptr() == eng[name].data_ptr()
    assert _judge(setup, "honest, shared")[0]
    eng[name][0, 0] += 1e-3
    passed, fig = _judge(setup, "shared, one element changed")
    assert not passed and fig["mismatched"] == [name]


# ---- FP8 and checkpoints ---------------------------------------------------------------------------
needs_fp8 = pytest.mark.skipif(not fp8_available(), reason="metainfer.model.fp8 is not in this build")


@needs_fp8
def test_fp8_prequant_digests(tiny_config, monkeypatch):
    setup = build_setup(f"dummy:{tiny_config}", "quick", {"device": "cpu", "quantization": "fp8"})
    assert setup.weights.mode == "independent" and setup.reference.info.weights == "recipe"
    assert setup.reference.model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    assert _judge(setup, "fp8 honest")[0]
    moe = setup.llm.engine.runner.model.layers[0].mlp
    saved = moe.w_down_scale.clone()
    moe.w_down_scale[0] *= 2  # the quantised weights' scales changed after the build
    try:
        passed, fig = _judge(setup, "fp8 scale changed after build")
        assert not passed and fig["mismatched_by"] == {"engine": ["moe.0.w_down_scale"]}
    finally:
        moe.w_down_scale.copy_(saved)

    import metainfer.engine.runner as runner
    from metainfer.model.weights import hf_state_dict

    original = runner.init_dummy

    def nudged(model, seed):  # a BF16 weight changed before quantisation
        original(model, seed)
        hf_state_dict(model)["model.layers.3.self_attn.o_proj.weight"][:4] *= 1.05

    monkeypatch.setattr(runner, "init_dummy", nudged)
    bad = build_setup(f"dummy:{tiny_config}", "quick", {"device": "cpu", "quantization": "fp8"})
    passed, fig = _judge(bad, "fp8, BF16 weight changed before quantisation")
    assert not passed and fig["mismatched_by"] == {"build": ["model.layers.3.self_attn.o_proj.weight"]}


def test_checkpoint_reference_digests(tmp_path):
    from tests.helpers import save_hf_model

    save_hf_model(tmp_path / "hf", seed=3)
    setup = build_setup(str(tmp_path / "hf"), "quick", {"device": "cpu"})
    assert setup.weights.mode == "checkpoint" and setup.weights.seed is None
    assert _judge(setup, "checkpoint honest")[0]
    view = _engine_views(setup)["model.layers.0.mlp.shared_expert.up_proj.weight"]
    view[5] *= 1.05
    passed, fig = _judge(setup, "checkpoint, engine weight changed")
    assert not passed and len(fig["mismatched"]) == 1
    shared = build_setup(str(tmp_path / "hf"), "quick", {"device": "cpu"}, reference="shared")
    assert shared.weights.mode == "shared" and _judge(shared, "shared checkpoint honest")[0]
