"""The tamper check: a candidate may change the engine, never what judges it.

Two rules, both checked on the diff base..candidate before anything runs:
- no touched path matches a protected pattern (the judge's code, its thresholds, the tests, loop.toml,
  and every repository file the judge's commands name);
- no added line outside those paths reaches into the judge from the engine's side (imports of the
  judge's modules or of the oracle's reference implementation, interpreter patching, process exits):
  the oracle runs the candidate's engine in its own process, so such code could bend it there.

Patterns: "dir/**" matches everything under dir; a pattern without "/" matches that file name in any
folder; anything else is an fnmatch pattern on the whole path.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

# regex -> why an added line matching it is tampering
FORBIDDEN = {
    r"\bmetainfer\.(oracle|bench|loop|kb)\b": "reaches into the judge's modules",
    r"\bfrom\s+metainfer\s+import\s+[^#\n]*\b(oracle|bench|loop|kb)\b": "reaches into the judge's modules",
    r"\btransformers\b": "reaches the oracle's reference implementation",
    r"\bsys\.modules\b|\bmeta_path\b|\bpath_hooks\b|\bbuiltins\b|\bsettrace\b|\bsetprofile\b": (
        "patches the interpreter"
    ),
    r"\bos\._exit\b|\bsys\.exit\b|\batexit\b": "ends the process behind the judge's back",
    r"\bpytest\b|PYTEST_CURRENT_TEST": "reacts to the test runner",
}


@dataclass(frozen=True)
class TamperFinding:
    path: str
    why: str
    line: str = ""

    def __str__(self) -> str:
        return f"{self.path}: {self.why}" + (f": {self.line.strip()[:120]!r}" if self.line else "")


def protected(path: str, patterns: tuple[str, ...] | list[str]) -> bool:
    for p in patterns:
        if p.endswith("/**"):
            if path.startswith(p[:-2]):
                return True
        elif "/" not in p:
            if fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], p):
                return True
        elif fnmatch.fnmatchcase(path, p):
            return True
    return False


def check_paths(files: list[str], patterns: tuple[str, ...] | list[str]) -> list[TamperFinding]:
    return [
        TamperFinding(f, "a protected path (the judge, its thresholds, the tests or loop.toml)")
        for f in files
        if protected(f, patterns)
    ]


def check_new_top_level(
    files: list[str], base_files: set[str], roots: tuple[str, ...] = ("",)
) -> list[TamperFinding]:
    """New modules in a folder that is first on a judge process's sys.path: the tree's root (where the
    commands run) and the folder of every script they run. There a new `json.py` or `torch/` would shadow
    the installed module of that name in the oracle's or the bench's own process."""
    out = []
    for root in roots:
        pre = root.rstrip("/") + "/" if root else ""
        names = {f[len(pre) :].split("/", 1)[0] for f in base_files if f.startswith(pre)}
        for f in files:
            if f in base_files or not f.startswith(pre) or not f.endswith((".py", ".so", ".pyd")):
                continue
            rest = f[len(pre) :]
            if "/" not in rest or rest.split("/", 1)[0] not in names:
                out.append(
                    TamperFinding(
                        f,
                        f"a new module in {root or 'the root'}/, first on the judge's "
                        "sys.path, where it could shadow an installed one",
                    )
                )
    return out


def check_added_lines(diff: str, extra: tuple[str, ...] | list[str] = ()) -> list[TamperFinding]:
    """Findings in the added lines of a unified diff (`git diff` output)."""
    rules = [(re.compile(r), why) for r, why in FORBIDDEN.items()]
    rules += [(re.compile(r), f"matches loop.toml's forbidden pattern {r!r}") for r in extra]
    out, path = [], "?"
    for line in diff.splitlines():
        if line.startswith("+++ "):
            path = line[6:] if line.startswith("+++ b/") else line[4:]
            continue
        if not line.startswith("+") or line.startswith("+++"):
            continue
        for rx, why in rules:
            if rx.search(line[1:]):
                out.append(TamperFinding(path, why, line[1:]))
                break
    return out


def script_dirs(commands: list[list[str]] | list[tuple[str, ...]], tree_files: set[str]) -> tuple[str, ...]:
    """The folders of the repository scripts the commands run (`python benchmarks/x.py`): first on those
    processes' sys.path."""
    dirs = {
        a.rsplit("/", 1)[0]
        for cmd in commands
        for a in cmd
        if a in tree_files and a.endswith(".py") and "/" in a
    }
    return tuple(sorted(dirs))


def command_files(commands: list[list[str]] | list[tuple[str, ...]], tree_files: set[str]) -> list[str]:
    """Repository files the judge's commands name (a benchmark script, a test file): protected too.
    A folder named by a command protects everything under it."""
    out = []
    folders = {f.rsplit("/", 1)[0] for f in tree_files if "/" in f}
    for cmd in commands:
        for arg in cmd:
            a = arg.split("::", 1)[0].strip("./") if not arg.startswith("{") else ""
            if a in tree_files:
                out.append(a)
            elif a in folders:
                out.append(a + "/**")
    return sorted(set(out))
