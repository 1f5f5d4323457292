"""The git operations of the loop: revisions, diffs, tree extraction, worktrees and the ratchet branch."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
from pathlib import Path


class GitError(RuntimeError):
    """A git command failed; the message carries its stderr."""


def git(repo: Path, *args: str, check: bool = True, data: bytes | None = None) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], input=data, capture_output=True)
    if check and r.returncode != 0:
        raise GitError(f"git {' '.join(args)}: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout.decode(errors="replace").strip() if r.returncode == 0 else ""


def toplevel(path: Path) -> Path:
    return Path(git(path, "rev-parse", "--show-toplevel"))


def rev(repo: Path, name: str) -> str:
    """The commit `name` names (40 hex digits); GitError when it names none."""
    return git(repo, "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}")


def exists(repo: Path, name: str) -> bool:
    try:
        return bool(rev(repo, name))
    except GitError:
        return False


def subject(repo: Path, sha: str) -> str:
    return git(repo, "log", "-1", "--format=%s", sha)


def message(repo: Path, sha: str) -> str:
    return git(repo, "log", "-1", "--format=%B", sha)


def changed_files(repo: Path, base: str, cand: str) -> list[str]:
    """Every path the diff base..cand touches; a rename counts as both of its paths."""
    out = git(repo, "diff", "--no-renames", "--name-only", base, cand)
    return [p for p in out.splitlines() if p]


def diff_text(repo: Path, base: str, cand: str, *paths: str) -> str:
    return git(repo, "diff", "--no-renames", "--no-color", base, cand, "--", *paths)


def diff_sha256(repo: Path, base: str, cand: str) -> str:
    """sha256 of the binary diff base..cand: the same change hashes the same whatever its commits."""
    r = subprocess.run(
        ["git", "-C", str(repo), "diff", "--binary", "--no-renames", base, cand],
        capture_output=True,
        check=True,
    )
    return hashlib.sha256(r.stdout).hexdigest()


def is_ancestor(repo: Path, old: str, new: str) -> bool:
    return subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", old, new]).returncode == 0


def extract(repo: Path, sha: str, dest: Path, *paths: str) -> Path:
    """The tree of commit `sha` (only `paths` when given) written into `dest` as plain files (no .git)."""
    r = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", sha, *paths], capture_output=True)
    if r.returncode != 0:
        raise GitError(f"git archive {sha}: {r.stderr.decode(errors='replace').strip()}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def tree_files(repo: Path, sha: str) -> list[str]:
    return [p for p in git(repo, "ls-tree", "-r", "--name-only", sha).splitlines() if p]


def worktree_add(repo: Path, path: Path, sha: str) -> Path:
    """A detached worktree of `sha` at `path` (a stale one there is removed first)."""
    worktree_remove(repo, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    git(repo, "worktree", "add", "--detach", "--force", str(path), sha)
    return path


def worktree_remove(repo: Path, path: Path) -> None:
    if path.exists():
        git(repo, "worktree", "remove", "--force", str(path), check=False)
    git(repo, "worktree", "prune", check=False)


def commit_all(worktree: Path, msg: str) -> bool:
    """Commits every change in `worktree` (one the loop owns); False when there was none."""
    git(worktree, "add", "-A")
    if not git(worktree, "status", "--porcelain"):
        return False
    git(
        worktree,
        "-c",
        "user.name=metainfer loop",
        "-c",
        "user.email=loop@metainfer.invalid",
        "commit",
        "-q",
        "--no-verify",
        "-m",
        msg,
    )
    return True


def set_ref(repo: Path, ref: str, sha: str) -> None:
    git(repo, "update-ref", ref, sha)


def fast_forward(repo: Path, branch: str, new: str) -> str:
    """Moves `branch` to `new` if that is a fast-forward (or creates it there). Returns what happened,
    in words; the branch never moves backwards or sideways."""
    ref = f"refs/heads/{branch}"
    if not exists(repo, ref):
        git(repo, "update-ref", ref, new, "0" * 40)
        return f"{branch} created at {new[:10]}"
    cur = rev(repo, ref)
    if cur == new:
        return f"{branch} already at {new[:10]}"
    if not is_ancestor(repo, cur, new):
        return f"{branch} not moved: its head {cur[:10]} is not an ancestor of {new[:10]}"
    git(repo, "update-ref", ref, new, cur)  # compare-and-swap: fails if it moved meanwhile
    return f"{branch} fast-forwarded {cur[:10]} -> {new[:10]}"


def exclude(repo: Path, pattern: str) -> None:
    """Adds `pattern` to the repository's own .git/info/exclude (not a tracked file) once."""
    info = Path(git(repo, "rev-parse", "--git-common-dir"))
    info = (info if info.is_absolute() else repo / info) / "info" / "exclude"
    text = info.read_text() if info.exists() else ""
    if pattern not in text.splitlines():
        info.parent.mkdir(parents=True, exist_ok=True)
        info.write_text(text + ("" if not text or text.endswith("\n") else "\n") + pattern + "\n")
