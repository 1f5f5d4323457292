"""`metainfer sam segment | verify`: outputs, exit codes, and one `error:` line for bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from metainfer.cli import main
from metainfer.sam.processing import rle_decode
from metainfer.sam.scenes import render_scene


@pytest.fixture(scope="module")
def scene_png(tmp_path_factory):
    d = tmp_path_factory.mktemp("img")
    img = render_scene(np.random.default_rng(5), 90, 130).image
    Image.fromarray(img).save(d / "scene.png")
    return d / "scene.png"


def _error_only(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_segment_json_and_overlays(scene_png, tiny_json, tmp_path, capsys):
    args = ["--image", str(scene_png), "--prompt", "red circle", "--prompt", "blue squares", "--json"]
    args += ["--model", f"dummy:{tiny_json}", "--out", str(tmp_path / "o"), "--threshold", "0.3"]
    rc = main(["sam", "segment", *args])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    (entry,) = doc["images"]
    assert (entry["height"], entry["width"]) == (90, 130)
    assert [p["prompt"] for p in entry["prompts"]] == ["red circle", "blue squares"]
    dets = [d for p in entry["prompts"] for d in p["detections"]]
    for d in dets:
        assert rle_decode(d["mask"]).shape == (90, 130)
        x0, y0, x1, y1 = d["box"]
        assert x1 >= x0 and y1 >= y0 and 0 < d["score"] <= 1
    pngs = sorted(p.name for p in (tmp_path / "o").iterdir())
    assert pngs == ["scene.blue_squares.png", "scene.red_circle.png"]
    assert Image.open(tmp_path / "o" / pngs[0]).size == (130, 90)


def test_segment_directory(scene_png, tiny_json, tmp_path, capsys):
    rc = main(["sam", "segment", "--image", str(scene_png.parent), "--prompt", "green triangle",
               "--model", f"dummy:{tiny_json}", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    assert "scene.png: 'green triangle'" in capsys.readouterr().out


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "unreadable",
        "empty_prompt",
        "absurd_size",
        "empty_dir",
        "bad_model",
        "corrupt_model",
        "bad_threshold",
    ],
)
def test_segment_bad_input(case, scene_png, tiny_json, tmp_path, capsys):
    image, prompt, extra = str(scene_png), "red circle", ["--model", f"dummy:{tiny_json}"]
    if case == "missing":
        image = str(tmp_path / "nope.png")
    elif case == "unreadable":
        (tmp_path / "bad.png").write_text("not an image")
        image = str(tmp_path / "bad.png")
    elif case == "empty_prompt":
        prompt = "   "
    elif case == "absurd_size":
        Image.new("RGB", (20000, 1)).save(tmp_path / "wide.png")
        image = str(tmp_path / "wide.png")
    elif case == "empty_dir":
        (tmp_path / "d").mkdir()
        image = str(tmp_path / "d")
    elif case == "bad_model":
        extra = ["--model", str(tmp_path / "no_model")]
    elif case == "corrupt_model":
        (tmp_path / "ck").mkdir()
        (tmp_path / "ck" / "config.json").write_text(open(tiny_json).read())
        (tmp_path / "ck" / "model.safetensors").write_bytes(b"garbage")
        extra = ["--model", str(tmp_path / "ck")]
    elif case == "bad_threshold":
        extra += ["--threshold", "1.5"]
    rc = main(["sam", "segment", "--image", image, "--prompt", prompt, "--out", str(tmp_path / "o"), *extra])
    assert rc == 2
    _error_only(capsys)


def test_verify_cli(tiny_json, tmp_path, capsys):
    out = tmp_path / "v.json"
    assert main(["sam", "verify", "--model", f"dummy:{tiny_json}", "--json", str(out)]) == 0
    v = json.loads(out.read_text())
    assert v["passed"] and v["target"] == "sam" and v["suite"] == "quick" and len(v["checks"]) >= 10
    assert "verdict: PASS" in capsys.readouterr().out
    assert main(["sam", "verify", "--model", f"dummy:{tiny_json}", "--mutant", "wrong_query_masks"]) == 1
    assert "verdict: FAIL" in capsys.readouterr().out


def test_verify_usage_errors(tmp_path, capsys):
    assert main(["sam", "verify", "--model", "dummy:" + str(tmp_path / "missing.json")]) == 2
    _error_only(capsys)
    assert main(["sam", "verify", "--mutant", "no_such_bug", "--model", "dummy"]) == 2
    _error_only(capsys)
