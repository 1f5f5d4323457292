"""Speculative decoding with the checkpoint's MTP layer (`spec.mtp`, `--speculative mtp`), on the
embedded default model (its MTP head is trained: 0.64 held-out acceptance) in fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM
from metainfer.spec import mtp as mtp_mod
from tests.helpers import token_prompts, write_config

TEXTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Parser(object):\n    def __init__(self",
]


def _llm(spec: str | None, **kw) -> LLM:
    if spec:
        kw.setdefault("speculative_max_seqs", 8)
    return LLM(device="cpu", dtype="float32", speculative=spec, **kw)


def _gen(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    usage = llm.engine.cache.usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    tok = _llm(None).engine.tokenizer
    return [tok.encode(t) for t in TEXTS]


GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("k,async_scheduling", [(1, True), (3, True), (3, False)])
def test_mtp_spec_equals_plain_greedy_and_accepts(prompts, k, async_scheduling):
    """Any drafts give plain greedy's tokens; the trained head's drafts are mostly accepted."""
    want = _gen(_llm(None, async_scheduling=async_scheduling), prompts, GREEDY)
    llm = _llm("mtp", num_speculative_tokens=k, async_scheduling=async_scheduling)
    assert _gen(llm, prompts, GREEDY) == want
    st = llm.engine.stats
    assert st["spec_verifies"] > 10 and st["spec_accepted"] > 0.4 * st["spec_drafted"], st


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_graph_layout_proposes_the_eager_drafts(prompts, k):
    """`MTPGraphs` (the catch-up chunk in the lone-prefill layout, the chained rows as single-row
    decodes fed on the device; on the CPU the layout runs eagerly) proposes exactly what the eager
    drafter does, long catch-ups (the prompt) included; outputs equal plain greedy."""
    sizes = dict(prefill_graphs=(4, 8, 16, 32))
    want = _gen(_llm(None, **sizes), prompts, GREEDY)
    logs = []
    for graphs in (False, True):
        llm = _llm("mtp", num_speculative_tokens=k, **(sizes if graphs else {}))
        g = llm.engine.runner.mtp.graphs
        assert (g is not None) == graphs and (not g or g.sizes == sorted({1, 2, 4, k + 1, 2 * k + 2}))
        propose, log = llm.engine.proposer, []

        def spy(req, kk, propose=propose, log=log):
            drafts = propose(req, kk)
            log.append((req.request_id, req.num_tokens, drafts))
            return drafts

        llm.engine.proposer = spy
        assert _gen(llm, prompts, GREEDY) == want
        logs.append(log)
        if graphs:
            assert g.runs >= len([d for *_, d in log if d]) > 5
    assert logs[0] == logs[1]


def _mtp_reference(model, ids: list[int]) -> torch.Tensor:
    """MTP logits [L-1, V] of one sequence, every row at once with fresh caches: row t sees the main
    model's hidden state at t and token t + 1 (the training script's measurement)."""
    from metainfer.forward_meta import CacheTensors, ForwardMeta

    c, L, bs = model.cfg, len(ids), 16
    nb = -(-L // bs)
    kv = (nb + 1, bs, c.num_key_value_heads, c.head_dim)
    n_full, n_lin = len(c.full_layer_ids), len(c.linear_layer_ids)
    caches = CacheTensors(
        k=[torch.zeros(kv) for _ in range(n_full + 1)],
        v=[torch.zeros(kv) for _ in range(n_full + 1)],
        conv=[torch.zeros(2, c.linear_conv_kernel_dim - 1, c.linear_conv_dim) for _ in range(n_lin)],
        ssm=[torch.zeros(2, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
             for _ in range(n_lin)],
    )

    def meta(n: int) -> ForwardMeta:
        return ForwardMeta.build([n], [0], [list(range(1, nb + 1))], [1], bs, list(range(n)), "cpu")

    x, pos = torch.tensor(ids), torch.arange(L)
    with torch.inference_mode():
        h = model(x, pos, meta(L), caches)
        hm = model.mtp(model.embed_tokens(x[1:]), h[:-1], pos[:-1], meta(L - 1), caches)
        return model.compute_logits(hm)


def test_mtp_first_drafts_are_the_full_sequence_mtp_argmax(prompts):
    """Each step's first draft (MTP rows caught up incrementally over prefill, decode and verify
    hidden rows, the KV in the request's blocks) is the argmax of the same MTP row computed over the
    whole final sequence at once, except at a near-tie (top-2 gap < 1e-4)."""
    llm = _llm("mtp", num_speculative_tokens=2)
    drafter = llm.engine.runner.mtp
    seen: list[tuple[int, int]] = []
    propose = drafter.propose

    def spy(req, k):
        drafts = propose(req, k)
        if drafts:
            seen.append((req.num_tokens, drafts[0]))
        return drafts

    llm.engine.proposer = spy
    out = _gen(llm, prompts[2:], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
    ref = _mtp_reference(llm.engine.runner.model, prompts[2] + out)
    assert len(seen) > 10
    for L, d in seen:
        row = ref[L - 2]
        top2 = row.topk(2).values
        assert d == int(row.argmax()) or float(top2[0] - top2[1]) < 1e-4, (L, d)


def test_mtp_chunked_prefill_preemption_and_stops(prompts):
    """Chunked prompts, preemption by recompute (the MTP KV goes with the blocks and is rebuilt from
    the resumed prefill's hidden rows), max_tokens inside a run of drafts, a sampled request (no
    drafts): plain greedy's tokens, and drafts for requests after their preemption."""
    more = prompts + token_prompts([3, 20, 31], seed=8, vocab=4000)
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 4 + [
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.8, seed=3, ignore_eos=True),
    ]
    kw = dict(max_num_batched_tokens=24, block_size=8, num_kv_blocks=16, max_model_len=96, max_num_seqs=6,
              async_scheduling=False)  # (async: the probes back off while requests wait: few drafts)
    want = _gen(_llm(None, **kw), more, params)
    llm = _llm("mtp", num_speculative_tokens=3, **kw)
    propose, resumed = llm.engine.proposer, []

    def spy(req, k):
        drafts = propose(req, k)
        if drafts and req.num_preemptions:
            resumed.append(req.request_id)
        return drafts

    llm.engine.proposer = spy
    assert _gen(llm, more, params) == want
    assert llm.engine.scheduler.num_preemptions > 0 and resumed
    assert llm.engine.stats["spec_accepted"] > 0


def test_mtp_rows_dropped_past_the_cap_end_its_drafts(prompts, monkeypatch):
    """A request holding more undrafted hidden rows than MAX_PENDING_ROWS drops them and drafts no
    more (its output unchanged); one within the cap drafts."""
    monkeypatch.setattr(mtp_mod, "MAX_PENDING_ROWS", 8)
    long, short = prompts[2], prompts[0][:5]
    assert len(long) > 8 >= len(short) + 1
    want = _gen(_llm(None), [long, short], GREEDY)
    llm = _llm("mtp", num_speculative_tokens=2)
    assert _gen(llm, [long], GREEDY) == want[:1]
    assert llm.engine.stats["spec_drafted"] == 0
    llm = _llm("mtp", num_speculative_tokens=2)  # (a fresh engine: the first one's probes backed off)
    assert _gen(llm, [short], GREEDY) == want[1:]
    assert llm.engine.stats["spec_drafted"] > 0


def test_mtp_needs_an_mtp_layer(tmp_path):
    cfg = write_config(tmp_path, mtp_num_hidden_layers=0)
    with pytest.raises(ValueError, match="MTP layer"):
        LLM(model=f"dummy:{cfg}", device="cpu", dtype="float32", speculative="mtp")


@pytest.mark.slow  # CI's second pass; the default suite runs this same verify through the CLI
# (tests/oracle/test_cli.py::test_cli_reports_the_speculative_verifies: exit 0, drafts and verifies)
def test_oracle_passes_an_mtp_speculative_engine():
    """`metainfer verify --speculative mtp --speculative-max-seqs 16` on the default model (quick
    suite, fp32 gates): the verify rows of MTP drafts judged against transformers."""
    pytest.importorskip("transformers")
    from metainfer.oracle.build import build_setup
    from metainfer.oracle.report import format_table
    from tests.oracle.oracle_helpers import verify

    setup = build_setup("", "quick", {"device": "cpu", "speculative": "mtp", "speculative_max_seqs": 16})
    v = verify(setup)
    assert v.passed, format_table(v)
    st = v.figures["engine_stats"]  # (the verdict JSON records them)
    assert st == setup.llm.engine.stats and st["spec_verifies"] > 0 and st["spec_accepted"] > 0, st


def test_mtp_acceptance_benchmark_runs(tmp_path):
    """benchmarks/mtp_acceptance.py on the default model: per-K acceptance JSON, every speculative
    output equal to plain greedy."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "p.txt").write_text("class Parser(object):\\n    def __init__(self\nimport os\\nimport sys\n")
    cmd = [sys.executable, str(root / "benchmarks" / "mtp_acceptance.py"), "--k", "1,3", "--gen", "16",
           "--device", "cpu", "--dtype", "float32", "--prompts", str(tmp_path / "p.txt"),
           "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # small ops: a second thread on shared cores only waits
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "mtp_acceptance.json").read_text())
    assert len(res["prompts"]) == 2 and res["prompts"][0].startswith("class Parser(object):\n")
    for k in ("1", "3"):
        t = res["k"][k]
        assert t["equal"] == 2 and t["verifies"] > 0
        assert 0 < t["accepted"] <= t["drafted"] <= int(k) * t["verifies"]


@pytest.mark.parametrize("graphs", [False, True])
def test_mtp_draft_vocabulary_limits_the_drafts(prompts, graphs):
    """speculative_draft_vocab=N: drafts among the ids below N only (lm_head's first N rows), on the
    eager drafter and the graph layout; outputs still plain greedy's, drafts still accepted."""
    kw = dict(prefill_graphs=(4, 8, 16, 32)) if graphs else {}
    want = _gen(_llm(None), prompts, GREEDY)
    # (with the whole vocabulary, 52 of these prompts' 82 drafts are >= 300)
    llm = _llm("mtp", num_speculative_tokens=3, speculative_draft_vocab=300, **kw)
    assert (llm.engine.runner.mtp.graphs is not None) == graphs
    propose, drafted = llm.engine.proposer, []

    def spy(req, k):
        drafts = propose(req, k)
        drafted.extend(drafts)
        return drafts

    llm.engine.proposer = spy
    assert _gen(llm, prompts, GREEDY) == want
    assert drafted and max(drafted) < 300
    assert llm.engine.stats["spec_accepted"] > 0


def test_a_failing_drafter_costs_drafts_not_requests(prompts, caplog):
    """A drafter that raises (here on every other call) is logged and counted; the step runs without
    drafts and every request still ends with plain greedy's tokens."""
    want = _gen(_llm(None), prompts, GREEDY)
    llm = _llm("mtp", num_speculative_tokens=2)
    propose, calls = llm.engine.proposer, []

    def flaky(req, k):
        calls.append(k)
        if len(calls) % 2:
            raise RuntimeError("drafter broke")
        return propose(req, k)

    llm.engine.proposer = flaky
    assert _gen(llm, prompts, GREEDY) == want
    st = llm.engine.stats
    assert st["spec_draft_errors"] == (len(calls) + 1) // 2 > 0 and st["spec_verifies"] > 0
    assert "drafting failed" in caplog.text


def test_mtp_rows_over_all_requests_are_bounded_and_freed(prompts, monkeypatch):
    """Held hidden rows over all requests stay within MAX_TOTAL_ROWS (a request that would pass it
    drops its rows and MTP drafts), finished requests free theirs, outputs stay plain greedy's."""
    monkeypatch.setattr(mtp_mod, "MAX_TOTAL_ROWS", 20)
    want = _gen(_llm(None), prompts, GREEDY)
    llm = _llm("mtp", num_speculative_tokens=2, max_num_batched_tokens=8)  # chunked prompts: rows pile up
    d = llm.engine.runner.mtp
    note, peak, lost = d.note, [], set()

    def watch(req, start, rows):
        note(req, start, rows)
        peak.append(d.total_rows)
        if d.state(req).lost:
            lost.add(req.request_id)

    d.note = watch
    assert _gen(llm, prompts, GREEDY) == want
    assert max(peak) <= 20 and d.total_rows == 0  # bounded, and every finished request freed its rows
    assert lost and len(lost) < len(prompts) and llm.engine.stats["spec_verifies"] > 0


def test_mtp_abort_mid_generation_frees_rows_and_spares_the_rest(prompts):
    """A request aborted while others draft and verify (async steps in flight): its hidden rows are
    freed, the engine keeps going, and the other requests end with plain greedy's tokens."""
    want = _gen(_llm(None), prompts, GREEDY)
    eng = _llm("mtp", num_speculative_tokens=3).engine
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    got: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = list(out.token_ids)
        steps += 1
        if steps == 6:
            assert eng.abort_request(ids[1]) is not None
    d = eng.runner.mtp
    assert d.total_rows == 0 and eng.stats["aborted"] == 1 and eng.stats["spec_verifies"] > 0
    assert [got[i] for i in ids if i != ids[1]] == [w for i, w in zip(ids, want) if i != ids[1]]
    assert eng.cache.usage()["kv_blocks_used"] == 0
