"""Engine on CUDA (skipped without a GPU): CUDA-graph replay == eager, kernels == reference path,
and greedy agreement with transformers on a small config with every layer kind."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from metainfer import settings
from metainfer.engine.request import SamplingParams
from metainfer.llm import LLM
from tests.helpers import TINY, rel_rmse

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# wide enough for the kernels' real code paths (GQA 8:1, head_dim 256, 128-row FP8 blocks)
SMALL = dict(
    TINY,
    hidden_size=512,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=4,
    linear_key_head_dim=128,
    linear_num_value_heads=8,
    linear_value_head_dim=128,
    num_experts=32,
    num_experts_per_tok=8,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    vocab_size=4096,
    num_hidden_layers=8,
)


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("gpu") / "config.json"
    p.write_text(json.dumps(SMALL))
    return p


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 4096, (int(L),), generator=g).tolist()
        for L in torch.randint(3, 300, (n,), generator=g)
    ]


def _run(llm, prompts, n=24):
    seen = {}

    def hook(owners, logits):
        for (req, kind, _pos), row in zip(owners, logits):
            if kind == "sample":
                seen.setdefault(req.request_id, []).append(row.float().cpu())

    llm.engine.runner.logits_hook = hook
    outs = llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    )
    return outs, [torch.stack(seen[o.request_id]) for o in outs]


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_graph_replay_equals_eager(cfg_path, quant):
    prompts = _prompts(6)
    kw = dict(
        model=f"dummy:{cfg_path}",
        device="cuda",
        dtype="bfloat16",
        quantization=quant,
        max_num_seqs=8,
        max_model_len=512,
    )
    graph = LLM(**kw)
    assert graph.engine.runner.decode.graphs, "CUDA graphs were not captured"
    go, gl = _run(graph, prompts)
    del graph
    eager = LLM(**kw, enforce_eager=True)
    eo, el = _run(eager, prompts)
    for a, b, x, y in zip(go, eo, gl, el):
        assert a.token_ids == b.token_ids
        assert torch.equal(x, y), rel_rmse(x, y)


def test_decode_graphs_recaptured_give_the_same_bits(tmp_path, monkeypatch):
    """ModelRunner.recapture_decode (benchmarks/ab_inproc.py's A/B in one process): the graphs captured again,
    with gemv.cu reloaded in between, replay the first capture's logits bit for bit; what the kernels see at
    capture takes effect (gemv.cu declining: the Triton projections, other bits, close logits)."""
    from metainfer.kernels.cuda import gemv

    prompts = _prompts(3)
    p = tmp_path / "config.json"  # hidden 2048: gemv.cu serves the projections
    p.write_text(json.dumps(dict(SMALL, hidden_size=2048, num_hidden_layers=4)))
    llm = LLM(model=f"dummy:{p}", device="cuda", dtype="bfloat16", quantization="fp8", max_num_seqs=1,
              max_model_len=512)
    first = [_run(llm, [p], n=12) for p in prompts]
    if gemv._kernel(torch.device("cuda")) is None:
        pytest.skip("gemv.cu cannot be built here (nvcc, sm_90): nothing to move")

    def same_as_first(runs):
        for (ao, al), (bo, bl) in zip(first, runs):
            assert ao[0].token_ids == bo[0].token_ids and torch.equal(al[0], bl[0])

    gemv.reset()
    llm.engine.runner.recapture_decode()
    assert llm.engine.runner.decode.graphs
    same_as_first([_run(llm, [p], n=12) for p in prompts])
    with monkeypatch.context() as mp:
        mp.setattr(gemv, "_kernel", lambda device: None)  # gemv.cu declines: the Triton projections
        llm.engine.runner.recapture_decode()
        triton = [_run(llm, [p], n=12) for p in prompts]
    # the first decode step (row 1: row 0 is the prefill's) has the same inputs either way: close, not equal
    firsts = [(a[1][0][1], b[1][0][1]) for a, b in zip(first, triton)]
    assert all(rel_rmse(x, y) < 2e-2 for x, y in firsts), [rel_rmse(x, y) for x, y in firsts]
    assert not all(torch.equal(x, y) for x, y in firsts), "the change did not reach the recaptured graph"
    # and back (A -> B -> A, as the A/B's rounds go): the first bits again
    llm.engine.runner.recapture_decode()
    same_as_first([_run(llm, [p], n=12) for p in prompts])


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_prefill_graph_replay_equals_its_eager_layout(cfg_path, quant):
    """Lone prompts (3, 100, 128, 300 tokens) through the lone-prefill graphs (sizes 128, 512): the
    replay gives the bits of the same padded layout run eagerly, and the plain step's logits to
    bf16 rounding (other batch shapes); the generated tokens after it through the decode graphs."""
    kw = dict(model=f"dummy:{cfg_path}", device="cuda", dtype="bfloat16", quantization=quant, max_num_seqs=8,
              max_model_len=512)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (3, 100, 128, 300)]
    llm = LLM(**kw, prefill_graphs=(128, 512))
    pg = llm.engine.runner.prefill
    assert pg is not None and sorted(pg.graphs) == [128, 512]
    runs = {}
    for mode in ("graph", "layout"):
        pg.use_graphs = mode == "graph"
        runs[mode] = [_run(llm, [p], n=4) for p in prompts]
    assert pg.runs == 2 * len(prompts)
    del llm
    plain = LLM(**kw, prefill_graphs=())
    assert plain.engine.runner.prefill is None
    base = [_run(plain, [p], n=4) for p in prompts]
    for (go, gl), (lo, ll), (_, bl) in zip(runs["graph"], runs["layout"], base):
        assert go[0].token_ids == lo[0].token_ids and torch.equal(gl[0], ll[0]), rel_rmse(gl[0], ll[0])
        assert rel_rmse(gl[0][0], bl[0][0]) < 2e-2


def _on_and_off(cfg_path, quant, prompts, off):
    """The engine's outputs and sampled-token logits as it is, then inside the context off() (a fresh engine
    each): zip(outputs, logits, off's outputs, off's logits)."""
    kw = dict(model=f"dummy:{cfg_path}", device="cuda", dtype="bfloat16", quantization=quant, max_num_seqs=8,
              max_model_len=512)
    llm = LLM(**kw)
    on = _run(llm, prompts)
    del llm
    with off():
        llm = LLM(**kw)
        runs = _run(llm, prompts)
        del llm
    return zip(*on, *runs)


def _patched(module, name: str, value):
    """A context factory for `_on_and_off`: module.name = value inside."""
    @contextlib.contextmanager
    def ctx():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(module, name, value)
            yield

    return ctx


def test_norm_quant_copy_equals_act_quant(cfg_path):
    """The norms before FP8 GEMMs of > 16 tokens write their output's e4m3 copy, so the cuBLAS projections
    and the grouped experts skip their act_quant launches: the same logits bits as the GEMMs quantising
    their input themselves."""
    from metainfer.kernels import fp8_linear

    off = _patched(fp8_linear, "norm_quant_wanted", lambda T, device: False)
    runs = _on_and_off(cfg_path, "fp8", _prompts(6, seed=7), off)
    for i, (a, x, b, y) in enumerate(runs):
        assert a.token_ids == b.token_ids, (i, a.token_ids, b.token_ids)
        assert torch.equal(x, y), (i, rel_rmse(x, y))


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_pdl_equals_serialised_launches(cfg_path, quant):
    """Programmatic dependent launch (graph replay and eager) gives the same logits bits as plain
    stream order: a kernel touching memory before its wait would race and show up here."""
    from metainfer.kernels import pdl

    if not pdl.enabled():
        pytest.skip("PDL needs sm_90 and Triton's griddepcontrol intrinsics")
    off = lambda: settings.override(pdl=False)  # noqa: E731  (METAINFER_PDL=0)
    for a, x, b, y in _on_and_off(cfg_path, quant, _prompts(6, seed=2), off):
        assert a.token_ids == b.token_ids
        assert torch.equal(x, y), rel_rmse(x, y)


def _rows_agree_until_they_part(runs, min_rows: int = 6 * 8) -> None:
    """`_on_and_off`'s runs: each sequence's logits rows within 1e-2 relative RMSE up to and including
    the first position where the two runs' tokens differ (a near-tie flipped by a rounding; later rows
    are conditioned on other tokens), and at least min_rows rows compared in all (not vacuous)."""
    compared = 0
    for a, x, b, y in runs:
        same = next((i for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids)) if s != t), len(a.token_ids))
        n = min(same + 1, len(x))
        assert rel_rmse(x[:n], y[:n]) < 1e-2, (same, rel_rmse(x[:n], y[:n]))
        compared += n
    assert compared >= min_rows, compared


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_norm_router_equals_two_launches(cfg_path, quant):
    """norm.ROUTER_MAX_T 8 (the constant) vs 0: the post-attention norm and the MoE router in one
    launch (decode batches 6 down to 1) give the two launches' logits to a rounding (the router's sums
    in another order): every row conditioned on the same tokens (up to the first differing token,
    a near-tie of the dummy model flipped by that rounding) within 1e-2 relative RMSE."""
    from metainfer.kernels import norm

    runs = _on_and_off(cfg_path, quant, _prompts(6, seed=5), _patched(norm, "ROUTER_MAX_T", 0))
    _rows_agree_until_they_part(runs)


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_gated_norm_linear_equals_two_launches(cfg_path, quant):
    """weight_stream.GNORM_MAX_T 1 (the constant) vs 0: the DeltaNet gated norm as out_proj's prologue (the
    6 prompts' batch-1 decode steps) gives the two launches' logits to a rounding, every row conditioned on
    the same tokens within 1e-2 relative RMSE (as test_norm_router_equals_two_launches)."""
    from metainfer.kernels import weight_stream as ws

    runs = _on_and_off(cfg_path, quant, _prompts(6, seed=6), _patched(ws, "GNORM_MAX_T", 0))
    _rows_agree_until_they_part(runs)


def test_kernels_match_reference_path(cfg_path):
    prompts = _prompts(4, seed=1)
    kw = dict(model=f"dummy:{cfg_path}", device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=512)
    fast = LLM(**kw)
    _, fl = _run(fast, prompts, n=8)
    del fast
    from metainfer.kernels import ops

    ops.use_kernels(False)
    try:
        slow = LLM(**kw, enforce_eager=True, extra={"no_kernels": True})
        _, sl = _run(slow, prompts, n=8)
    finally:
        ops.use_kernels(True)
    for x, y in zip(fl, sl):  # the first step is teacher-forced identically; later ones follow greedy
        assert rel_rmse(x[0], y[0]) < 2e-2


def _spec_rows(llm):
    """Every logits row a speculative engine computes, with what it is conditioned on: a list of
    (prompt, position, kind, [(position, draft token) among its inputs], row fp32 on the CPU); rows after
    a draft are kept by `_conditioned` only if each draft among their inputs is the final token there."""
    rows = []

    def hook(owners, logits):
        first = {}
        for req, kind, pos in owners:
            if kind == "verify":
                first.setdefault(req.request_id, pos)  # the row after the chunk's last real token
        for (req, kind, pos), row in zip(owners, logits):
            if kind not in ("sample", "verify"):
                continue
            drafts = []
            if kind == "verify":
                f = first[req.request_id]
                drafts = [(f + 1 + j, t) for j, t in enumerate(req.draft_token_ids) if f + 1 + j <= pos]
            rows.append((tuple(req.prompt_token_ids), pos, kind, drafts, row.float().cpu()))

    llm.engine.runner.logits_hook = hook
    return rows


def _conditioned(rows, prompt, tokens):
    """{position: [(kind, row)]} of `prompt`'s rows whose draft inputs all equal the final `tokens`."""
    final = list(prompt) + list(tokens)
    out = {}
    for p, pos, kind, drafts, row in rows:
        if p == tuple(prompt) and all(q < len(final) and final[q] == t for q, t in drafts):
            out.setdefault(pos, []).append((kind, row))
    return out


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_speculative_verify_equals_plain_greedy(cfg_path, quant):
    """Speculative decoding on the CUDA kernels (verify steps eager, recompute chunks on the
    lone-prefill graphs), drafts half right, half wrong (the states restored after each rejection),
    batched and each prompt alone: every logits row conditioned on the final tokens (a verify row
    only where its drafts were accepted) is plain decoding's row to rounding (relative RMSE < 2e-2,
    the path test's bound: verify chunks and decode steps round differently, and in FP8 a verify step
    of > 16 tokens quantises its activations to e4m3 where a decode step does not), and where the
    greedy tokens part from plain's, that rounding explains it: plain's top-2 gap there is at most
    twice the row's largest logit deviation (a flip needs the top two to cross). Exact ties part
    even for a one-ulp change (BF16 logits near 30 step by 0.125; 2026-11-30l: a gap of 0.0000 at
    token 9; 2026-11-30j: split-KV attention parted at a 0.125 gap)."""
    prompts = _prompts(4, seed=5)
    kw = dict(model=f"dummy:{cfg_path}", device="cuda", dtype="bfloat16", quantization=quant,
              max_num_seqs=8, max_model_len=512)
    plain = LLM(**kw)
    po, pl = _run(plain, prompts, n=24)
    del plain
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, po)}

    def half_right(req, k):
        cont = truth[tuple(req.prompt_token_ids)][len(req.output_token_ids):][:k]
        h = len(cont) // 2
        return cont[:h] + [(t + 1) % 4096 for t in cont[h:]]

    spec = LLM(**kw, speculative="ngram", num_speculative_tokens=4, speculative_max_seqs=8)
    spec.engine.proposer = half_right
    rows = _spec_rows(spec)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    so = spec.generate(prompt_token_ids=prompts, sampling_params=sp)  # verify steps of several: eager
    st = spec.engine.stats
    assert 0 < st["spec_accepted"] < st["spec_drafted"]
    runs = spec.engine.runner.prefill.runs
    batched, rows[:] = list(rows), []
    alone = [spec.generate(prompt_token_ids=[p], sampling_params=sp)[0] for p in prompts]
    assert spec.engine.runner.prefill.runs > runs + len(prompts)  # lone verifies replayed graphs
    bound = 0.16 if quant is None else 0.5  # twice the oracle's decode bound (0.08 BF16, 0.25 FP8)
    verified = 0
    for run, rws in (("batched", batched), ("alone", rows)):
        for prompt, o, b, ref in zip(prompts, so if run == "batched" else alone, po, pl):
            got = _conditioned(rws, prompt, o.token_ids)
            part = next((i for i, (x, y) in enumerate(zip(o.token_ids, b.token_ids)) if x != y), None)
            for i in range(len(b.token_ids) if part is None else part + 1):
                cands = [r for _, r in got.get(len(prompt) - 1 + i, [])]
                assert cands, (run, i, "no row conditioned on the final tokens")
                verified += sum(k == "verify" for k, _ in got[len(prompt) - 1 + i])
                dev = max((r - ref[i]).abs().max().item() for r in cands)
                assert max(rel_rmse(r, ref[i]) for r in cands) < bound, (run, i, dev)
                if i == part:
                    top2 = ref[i].topk(2).values
                    gap = (top2[0] - top2[1]).item()
                    assert gap <= 2 * dev, (f"{run}: parts from plain at token {i}, plain's top-2 gap "
                                            f"{gap:.4f} > twice the row's largest logit deviation {dev:.4f}")
    assert verified > 0  # verify rows (after accepted drafts) were compared, not only decode rows


def _mtp_llm(tmp_path, quant):
    """An MTP-drafting engine (K = 3) on SMALL with one MTP layer, dummy weights, CUDA graphs."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(SMALL, mtp_num_hidden_layers=1)))
    return LLM(model=f"dummy:{cfg}", device="cuda", dtype="bfloat16", quantization=quant, max_num_seqs=8,
               max_model_len=512, speculative="mtp", num_speculative_tokens=3, speculative_max_seqs=8)


def _first_drafts_agree(llm, both, pairs) -> list[bool]:
    """Four prompts alone (32 greedy tokens each) with `both` as the proposer, which records (one
    way's drafts, the other's) in pairs: whether the first drafts agree, per proposal."""
    llm.engine.proposer = both
    llm.engine.SPEC_PROBE_MAX = 0  # no backoff: dummy drafts verify to nothing, every chance is drafted
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs = [llm.generate(prompt_token_ids=[p], sampling_params=sp)[0] for p in _prompts(4, seed=9)]
    assert all(len(o.token_ids) == 32 for o in outs)
    return [a[0] == b[0] for a, b in pairs if a and b]


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_mtp_graphs_propose_the_eager_drafts(tmp_path, quant):
    """`--speculative mtp` on the CUDA kernels: each proposal made twice from the same state, by the
    eager drafter and by the captured `MTPGraphs` (the chunk padded to its graph size, the chained
    rows as one-row decodes): the first drafts agree in >= 60 % of proposals (dummy weights: near-ties
    every few tokens, and the padded chunk takes other MoE tiles; a wrong KV slot or hidden row gives
    ~0 %), and the run ends with no problems (the CPU test holds the two to exact equality in fp32)."""
    llm = _mtp_llm(tmp_path, quant)
    d = llm.engine.runner.mtp
    g = d.graphs
    assert g is not None and g.use_graphs and g.graphs
    pairs = []

    def both(req, k):
        st = d.state(req)
        done = st.done
        d.graphs = None
        eager = d.propose(req, k)
        st.done, d.graphs = done, g
        got = d.propose(req, k)
        pairs.append((eager, got))
        return got

    firsts = _first_drafts_agree(llm, both, pairs)
    assert len(firsts) > 8 and sum(firsts) >= 0.6 * len(firsts), (sum(firsts), len(firsts))
    assert g.runs >= len(firsts)
