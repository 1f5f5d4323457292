"""The oracle passes our model and fails each planted bug (mutants patch a copy of OUR model)."""

from __future__ import annotations

import pytest

from metainfer.sam.mutants import MUTANTS
from metainfer.sam.oracle import GATES, build_suite, format_table, verify
from metainfer.sam.reference import Reference


@pytest.fixture(scope="module")
def setup(tiny):
    return Reference(tiny), build_suite("quick", 0)


def test_suite_shape():
    s = build_suite("quick", 0)
    sizes = {c.image.shape[:2] for c in s.cases}
    assert len(sizes) == 3 and all(h != w for h, w in sizes)
    counts = [len(c.prompts) for c in s.cases]
    assert 1 in counts and max(counts) >= 3
    assert sum(e for c in s.cases for e in c.empty) == 1
    full = build_suite("full", 0)
    assert (1008, 1008) in {c.image.shape[:2] for c in full.cases}
    assert build_suite("quick", 0).cases[1].prompts == s.cases[1].prompts  # seeded


def test_passes_on_our_model(tiny, tok, setup):
    ref, suite = setup
    v = verify(tiny, tok, suite, ref)
    assert v.passed, format_table(v)
    assert [c.name for c in v.checks] == list(GATES)
    by = {c.name: c.value for c in v.checks}
    assert by["score_max_abs_diff"] < 1e-5 and by["mask_logit_cosine_min"] > 0.99999
    assert v.to_json()["target"] == "sam"


# which checks must fail for each planted bug
EXPECTED = {
    "skip_global_attention": {"score_max_abs_diff", "mask_logit_cosine_min"},
    "drop_presence": {"score_max_abs_diff"},
    "wrong_query_masks": {"mask_logit_cosine_min"},
    "prompt_independent": {"score_max_abs_diff", "batch_score_max_abs_diff"},
    "cross_image_leak": {"score_max_abs_diff", "batch_score_max_abs_diff", "batch_mask_logit_cosine_min"},
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_catches_mutant(name, tiny, tok, setup):
    ref, suite = setup
    v = verify(MUTANTS[name](tiny), tok, suite, ref)
    failed = {c.name for c in v.checks if not c.passed}
    assert not v.passed
    assert EXPECTED[name] <= failed, failed


def test_low_precision_run_reports_the_references_own_drift(tiny, tok, setup):
    import copy

    import torch

    from metainfer.sam.weights import init_buffers

    ref, suite = setup
    low = copy.deepcopy(tiny).to(torch.bfloat16)
    init_buffers(low, "cpu")
    v = verify(low, tok, suite, ref)
    d = v.to_json()["reference_own_drift"]
    assert d["dtype"] == "bfloat16" and 0 < d["score_max_abs_diff"] < 0.2
    assert "reference's own bfloat16 drift" in format_table(v)


@pytest.mark.slow
def test_full_suite_passes(tiny, tok, setup):
    """6 images up to 1333×750 and 1008², 16 prompts, two empty-result prompts (~1 min on 2 cores)."""
    ref, _ = setup
    v = verify(tiny, tok, build_suite("full", 0), ref)
    assert v.passed, format_table(v)
    assert v.context["kept_reference"] > 0
