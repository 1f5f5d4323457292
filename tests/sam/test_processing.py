"""Pre/postprocessing: normalisation, kept-only mask upsampling, pixel boxes, COCO RLE, image loading."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from metainfer.sam.model import SamOutput
from metainfer.sam.processing import load_image, postprocess, preprocess, rle_decode, rle_encode
from metainfer.sam.tokenizer import PromptTokenizer


def test_preprocess_resizes_and_normalises():
    img = np.zeros((30, 50, 3), dtype=np.uint8)
    img[..., 0] = 255
    x = preprocess(img, 28)
    assert x.shape == (3, 28, 28) and x.dtype == torch.float32
    assert torch.allclose(x[0], torch.ones(28, 28)) and torch.allclose(x[1], -torch.ones(28, 28))


def test_postprocess_keeps_scores_above_threshold_and_scales_boxes():
    q, m = 4, 8
    logits = torch.tensor([[4.0, -4.0, 0.5, 3.0]])
    presence = torch.tensor([[10.0]])
    boxes = torch.tensor([[[0.1, 0.2, 0.5, 0.6]] * q])
    masks = torch.full((1, q, m, m), -10.0)
    masks[0, 0, :4, :] = 10.0  # top half
    out = SamOutput(logits, presence, boxes, masks)
    (d,) = postprocess(out, [(20, 30)], threshold=0.7)
    assert d.query.tolist() == [0, 3]
    assert d.masks.shape == (2, 20, 30) and d.masks.dtype == torch.bool
    assert d.masks[0, :9].all() and not d.masks[0, 11:].any() and not d.masks[1].any()
    assert torch.allclose(d.boxes[0], torch.tensor([3.0, 4.0, 15.0, 12.0]))
    (e,) = postprocess(SamOutput(logits, torch.tensor([[-10.0]]), boxes, masks), [(20, 30)])
    assert e.masks.shape == (0, 20, 30) and rle_encode(e.masks) == []


def test_rle_roundtrip():
    rng = np.random.default_rng(0)
    masks = torch.from_numpy(rng.random((3, 17, 23)) > 0.5)
    rles = rle_encode(masks)
    assert all(r["size"] == [17, 23] and isinstance(r["counts"], str) for r in rles)
    for r, m in zip(rles, masks):
        assert (rle_decode(r) == m.numpy()).all()


def test_load_image_errors(tmp_path):
    Image.new("RGB", (5, 7), (1, 2, 3)).save(tmp_path / "ok.png")
    assert load_image(tmp_path / "ok.png").shape == (7, 5, 3)
    Image.new("L", (5, 7)).save(tmp_path / "grey.png")
    assert load_image(tmp_path / "grey.png").shape == (7, 5, 3)
    (tmp_path / "junk.jpg").write_bytes(b"\x00" * 10)
    for bad in (tmp_path / "none.png", tmp_path / "junk.jpg", tmp_path):
        with pytest.raises(ValueError):
            load_image(bad)


def test_tokenizer_pads_and_marks(tok: PromptTokenizer):
    ids, valid = tok.encode(["Red   Circle", "small green triangles"])
    assert ids.shape == valid.shape == (2, tok.context)
    assert ids[0, 0] == tok.bos and valid[0].sum() == 4 and ids[0, 3] == tok.eos
    with pytest.raises(ValueError):
        tok.encode([" "])
    long_ids, long_valid = tok.encode(["red " * 100])
    assert long_valid.all() and long_ids[0, -1] == tok.eos


def test_tokenizer_from_vocab_and_merges(tmp_path, tok):
    """A CLIP checkpoint's vocab.json + merges.txt give the same ids as its tokenizer.json."""
    import json

    state = json.loads(tok.tok.to_str())
    (tmp_path / "vocab.json").write_text(json.dumps(state["model"]["vocab"]))
    merges = state["model"]["merges"]
    lines = [" ".join(m) if isinstance(m, list) else m for m in merges]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(lines) + "\n")
    other = PromptTokenizer.from_dir(tmp_path, tok.context)
    prompts = ["red circle", "Large BLUE squares", "yellow triangle!"]
    assert torch.equal(other.encode(prompts)[0], tok.encode(prompts)[0])
