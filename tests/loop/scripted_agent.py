"""A scripted coding agent for the loop's tests: each call applies the next step of a plan (JSON list) to
the worktree it runs in and commits it.

    python scripted_agent.py PLAN.json BRIEF.md

A step: {"edits": [{"file", "old", "new"}], "message": str, "commit": bool (default true)}, or
{"crash": true} (exits 3 without touching anything). The step counter is PLAN.json's sibling
PLAN.json.next. Every call checks that the brief it was given (argument and $LOOP_BRIEF) exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def main() -> int:
    plan_path, brief = Path(sys.argv[1]), Path(sys.argv[2])
    assert brief.is_file() and os.environ["LOOP_BRIEF"] == str(brief), (brief, os.environ.get("LOOP_BRIEF"))
    assert "## Goal" in brief.read_text()
    counter = plan_path.with_name(plan_path.name + ".next")
    i = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(i + 1))
    step = json.loads(plan_path.read_text())[i]
    print(f"scripted agent: step {i}: {step.get('message', 'crash')}")
    if step.get("crash"):
        print("scripted agent: crashing on purpose", file=sys.stderr)
        return 3
    for e in step["edits"]:
        f = Path(e["file"])
        text = f.read_text()
        if e["old"] not in text:
            print(f"scripted agent: {e['old']!r} not in {f}", file=sys.stderr)
            return 4
        f.write_text(text.replace(e["old"], e["new"], 1))
    if step.get("commit", True):
        subprocess.run(
            [
                "git",
                "-c",
                "user.name=agent",
                "-c",
                "user.email=agent@test.invalid",
                "commit",
                "-q",
                "-a",
                "-m",
                step["message"],
            ],
            check=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
