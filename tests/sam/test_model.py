"""Our SAM 3 model against transformers' Sam3Model on a tiny config, fp32, shared weights.

Tolerance: max |Δ| ≤ 1e-4 on query logits, presence logits, normalised boxes and mask logits (measured:
~1e-7; the same ops in the same order, so only reduction-order rounding differs)."""

from __future__ import annotations

import pytest
import torch

from metainfer.sam.config import SamConfig, tiny_config
from metainfer.sam.model import unused_key
from metainfer.sam.reference import Reference
from metainfer.sam.weights import count_parameters, dummy_model, empty_model, load_checkpoint, save_checkpoint

ATOL = 1e-4


def _inputs(cfg, n_images: int, lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(n_images, 3, cfg.image_size, cfg.image_size, generator=g)
    ids = torch.randint(2, cfg.vocab_size, (len(lengths), cfg.text_context), generator=g)
    valid = torch.arange(cfg.text_context)[None] < torch.tensor(lengths)[:, None]
    return pixels, ids, valid


def _close(ours, ref):
    for name in ("logits", "presence_logits", "boxes", "masks"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.shape == b.shape, name
        assert (a - b).abs().max().item() <= ATOL, (name, (a - b).abs().max().item())


@torch.no_grad()
def test_matches_transformers_per_image(tiny):
    ref = Reference(tiny)
    cfg = tiny.config
    pixels, ids, valid = _inputs(cfg, 2, [3, 16, 7])  # a full-context prompt among short ones
    index = torch.tensor([0, 0, 1])
    ours = tiny(pixels, ids, valid, index)
    for i in range(2):
        rows = (index == i).nonzero().flatten()
        r = ref(pixels[i : i + 1], ids[rows], valid[rows])
        for name in ("logits", "presence_logits", "boxes", "masks"):
            a, b = getattr(ours, name)[rows], getattr(r, name)
            assert (a - b).abs().max().item() <= ATOL, name


@torch.no_grad()
def test_matches_transformers_other_shapes():
    """No window padding (grid a multiple of the window), several global layers, 1 text layer, 3 heads."""
    cfg = tiny_config(image_size=112, window_size=4, global_layers=(0, 2), vision_heads=4, text_layers=1,
                      heads=8, num_queries=5, pretrain_image_size=112)  # fmt: skip
    model = dummy_model(cfg, seed=3)
    pixels, ids, valid = _inputs(cfg, 1, [4], seed=1)
    _close(model(pixels, ids, valid), Reference(model)(pixels, ids, valid))


def test_outputs_depend_on_image_and_prompt(tiny):
    cfg = tiny.config
    pixels, ids, valid = _inputs(cfg, 2, [4, 4])
    with torch.no_grad():
        a = tiny(pixels, ids, valid, torch.tensor([0, 1]))
        b = tiny(pixels, ids.flip(0), valid, torch.tensor([0, 1]))
    assert (a.scores() - b.scores()).abs().max() > 1e-3
    assert (a.masks[0] - a.masks[1]).abs().max() > 1e-3


def test_loads_a_transformers_checkpoint(tmp_path):
    """save_pretrained's directory (all of Sam3Model's tensors, the unused ones included) loads as stored."""
    from transformers import Sam3Config, Sam3Model

    cfg = tiny_config()
    torch.manual_seed(0)
    hf = Sam3Model(Sam3Config(**cfg.to_hf())).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path, "cpu", torch.float32)
    pixels, ids, valid = _inputs(cfg, 1, [5])
    with torch.no_grad():
        r = hf(pixel_values=pixels, input_ids=ids, attention_mask=valid.long())
        o = ours(pixels, ids, valid)
    assert (o.masks - r.pred_masks).abs().max() <= ATOL
    assert (o.logits - r.pred_logits).abs().max() <= ATOL
    assert (o.boxes - r.pred_boxes).abs().max() <= ATOL


def test_save_load_roundtrip(tiny, tmp_path):
    save_checkpoint(tiny, tmp_path)
    back = load_checkpoint(tmp_path, "cpu", torch.float32)
    assert back.config == tiny.config
    for (k, a), (_, b) in zip(tiny.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k


def test_config_roundtrip_and_validation():
    for cfg in (SamConfig(), tiny_config()):
        assert SamConfig.from_hf(cfg.to_hf()) == cfg
    assert SamConfig.from_hf({"detector_config": tiny_config().to_hf()}) == tiny_config()
    with pytest.raises(ValueError):
        tiny_config(image_size=141)
    with pytest.raises(ValueError):
        tiny_config(global_layers=(9,))


def test_full_config_on_meta():
    """The released shape, built on the meta device (no memory): parameter counts of each stage."""
    m = empty_model(SamConfig())
    assert all(p.is_meta for p in m.parameters())
    vision = count_parameters(m.vision_encoder)
    text = count_parameters(m.text_encoder)
    assert 450e6 < vision < 456e6 and 350e6 < text < 356e6
    assert (
        825e6 < count_parameters(m) < 840e6
    )  # + box-prompt encoder and unused heads = 840 M in the checkpoint
    names = set(m.state_dict())
    from transformers import Sam3Config, Sam3Model

    with torch.device("meta"):
        hf = Sam3Model(Sam3Config())
    hf_names = set(hf.state_dict())
    assert names <= hf_names
    assert all(unused_key(m.config, k) for k in hf_names - names)


def test_dummy_init_on_meta_then_device_is_seeded():
    cfg = tiny_config()
    a, b, c = dummy_model(cfg, seed=1), dummy_model(cfg, seed=1), dummy_model(cfg, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert not any(t.is_meta for t in sa.values())


def test_dummy_init_is_peaked(tiny):
    """On the calibration scenes: 5-20 % of queries clear 0.5 and mask logits are decisive."""
    from metainfer.sam.weights import calibration_batch

    with torch.no_grad():
        o = tiny(*calibration_batch(tiny.config, "cpu", torch.float32, 0))
    kept = (o.scores() > 0.5).float().mean().item()
    assert 0.05 <= kept <= 0.2
    assert (o.masks.abs() < 0.05).float().mean().item() < 0.05
    assert o.presence_logits.sigmoid().min() > 0.8
