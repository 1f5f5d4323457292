"""The full suite (the GPU's) on the CPU, on the tiny config: the honest engine passes it, and the
verdict records the coverage the bench relies on (decode steps of 128 sequences, the longest
context, lone prefills, preemptions)."""

from __future__ import annotations

import pytest

from tests.oracle.oracle_helpers import verify

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def test_full_suite_passes_on_the_cpu(tiny_config):
    from metainfer.oracle.build import build_setup

    setup = build_setup(f"dummy:{tiny_config}", "full", {"device": "cpu"})
    v = verify(setup)
    cov = v.figures["coverage"]
    print("coverage:", cov, "timing:", v.context["timing"])
    assert v.passed, v.failed
    assert cov["max_decode_batch"] >= 128
    assert cov["max_position"] >= 4000  # the tiny config's 4,096 positions cap the 8k prompt
    assert cov["lone_prefill_steps"] >= 1 and cov["mixed_steps"] >= 1 and cov["preemptions"] >= 1
