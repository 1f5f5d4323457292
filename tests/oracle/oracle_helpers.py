"""Helpers for the oracle tests."""

from __future__ import annotations


def verify(setup, gates=None):
    """run_verify on a Setup with its precision's gates (or `gates`)."""
    from metainfer.oracle.compare import GATES
    from metainfer.oracle.verify import run_verify

    return run_verify(setup.llm, setup.reference, setup.suite, gates or GATES[setup.precision])
