"""experiments/gemv_timeline.py's host side on the CPU: the timeline build switched on and off around each
mode, and the launches' names (the run itself needs the H200)."""

from __future__ import annotations

import sys
from pathlib import Path

from metainfer.kernels.cuda import gemv
from metainfer.kernels.cuda import gemv_timeline as T

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import gemv_timeline as bench  # noqa: E402


def test_timeline_build_switches_the_next_load(monkeypatch):
    resets = []
    monkeypatch.setattr(gemv, "reset", lambda: resets.append(gemv._TIMELINE))
    bench.timeline_build(True)
    bench.timeline_build(False)
    assert resets == [True, False] and not gemv._TIMELINE


def _launch(kind: str, n_rows: int) -> T.Launch:
    return T.Launch(seq=0, kind=kind, n_rows=n_rows, grid=132, t0_us=0.0, events={"end": [1.0]}, waits={})


def test_labels_name_the_gate_up_by_its_layer():
    qkv, inp = _launch("gemv_e4m3_pre", 9216), _launch("gemv_e4m3_pre", 12352)
    moe = _launch("moe_gate_up_e4m3", 9216)
    assert bench.label(qkv, moe) == "attention qkv" and bench.label(inp, moe) == "DeltaNet in_proj"
    assert bench.label(moe, qkv) == "experts' gate/up (attention layer)"
    assert bench.label(moe, inp) == "experts' gate/up (DeltaNet layer)"
    assert bench.label(_launch("gemv_e4m3", 12352), None) == "layer 0's in_proj"
    assert bench.label(_launch("gemv_e4m3", 4096), None) == "gemv_e4m3 4096 rows"


def test_run_mode_records_each_replay(monkeypatch):
    """run_mode's data flow with the engine, the graph and the records faked: each replay's records decoded
    and summarized, the first step kept whole, the result JSON-serialisable."""
    import json
    from types import SimpleNamespace

    import torch

    from tests.kernels.test_gemv_timeline import _step

    buf, _ = _step(8)
    replays = []

    class FakeRecorder:
        def __init__(self, device, slots):
            self.cleared = 0

        def clear(self):
            self.cleared += 1

        def read(self):
            return buf.clone()

        def close(self):
            pass

    graph = SimpleNamespace(replay=lambda: replays.append(1))
    llm = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(
        device=torch.device("cpu"), decode=SimpleNamespace(graphs={1: graph}))))
    entered = []
    switches = SimpleNamespace(enter=lambda _llm, mode: entered.append((mode, gemv._TIMELINE)))
    monkeypatch.setattr(bench, "decode_run", lambda *a: {"decode_tok_s": 600.0, "tokens_sha1": "abc",
                                                         "errors": []})
    monkeypatch.setattr(bench, "graph_replay_ms", lambda *a: 1.66)
    monkeypatch.setattr(T, "Recorder", FakeRecorder)
    monkeypatch.setattr(gemv, "reset", lambda: None)
    monkeypatch.setattr(gemv, "_TIMELINE", False)
    args = SimpleNamespace(baseline=True, prompt_len=1024, gen=8, slots=256, steps=3)
    out = bench.run_mode(llm, {"pdl": False}, switches, args, seed=1)
    assert entered == [({"pdl": False}, False), ({"pdl": False}, True)]
    assert len(replays) == 3 and out["launches_a_step"] == [8, 8, 8]
    assert out["replay_ms_default_build"] == out["replay_ms_records_on"] == 1.66
    names = {r["name"] for r in out["summary"]}
    assert names == {"DeltaNet in_proj", "experts' gate/up (DeltaNet layer)"}
    assert len(out["first_step"]) == 8
    assert out["first_step"][1]["label"] == "experts' gate/up (DeltaNet layer)"
    json.dumps(out)  # (NaN is allowed by json.dumps)


def test_plot_from_a_saved_run(tmp_path):
    """--plot draws each mode's first step from a saved JSON (no GPU): one PNG a mode."""
    import json

    from tests.kernels.test_gemv_timeline import _step

    lns = T.decode(_step(12)[0])
    first = [{"seq": ln.seq, "label": bench.label(ln, lns[i - 1] if i else None), "t0_us": ln.t0_us,
              "events": ln.events, "waits": ln.waits} for i, ln in enumerate(lns)]
    run = tmp_path / "gemv_timeline.json"
    run.write_text(json.dumps({"modes": {"default": {"first_step": first}, "B=1": {"first_step": first}}}))
    bench.main(["--plot", str(run), "--out", str(tmp_path / "png")])
    pngs = sorted((tmp_path / "png").iterdir())
    assert [p.name for p in pngs] == ["gemv_timeline_0.png", "gemv_timeline_1.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 5000 for p in pngs)
