"""Run facts recorded in result files (metainfer/runinfo.py)."""

from __future__ import annotations

import math
from pathlib import Path

from metainfer import runinfo, settings


def test_git_commit_override():
    with settings.override(git_commit="0123abc"):  # GIT_COMMIT: a copy with a stale .git reports it
        assert runinfo.git("rev-parse", "HEAD") == "0123abc"
    with settings.override(git_commit=None):
        head = runinfo.git("rev-parse", "HEAD")
    assert head is None or len(head) == 40  # this checkout's HEAD, or None without git


def test_jsonable():
    assert runinfo.jsonable({"a": [math.nan, math.inf, -math.inf, Path("x"), 1.5]}) == {
        "a": [None, "inf", "-inf", "x", 1.5]
    }
