"""Helpers for the oracle tests."""

from __future__ import annotations


def verify(setup, gates=None):
    """run_verify on a Setup with its precision's gates (or `gates`)."""
    from metainfer.oracle.verify import verify_setup

    return verify_setup(setup, gates)
