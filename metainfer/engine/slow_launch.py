"""What a slow step launch spent its time on (the start-up warmup's blind spots): the Triton kernels
it JIT-compiled, by name (a recorder chained onto `triton.knobs.runtime.jit_post_compile_hook`, which
Triton calls after each compile; not under TRITON_INTERPRET, which compiles nothing), and the CUDA
caching allocator's new segments (cudaMalloc) and retries (a free-all and a device sync) since the
previous note."""

from __future__ import annotations

import threading

_names: list[str] = []
_lock = threading.Lock()
_installed = False


def _record(name: str) -> None:
    with _lock:
        _names.append(name)


def install() -> bool:
    """Chains the recorder onto Triton's post-compile hook, once per process (a hook already there
    still runs, after it). -> whether it is installed (False without a Triton that has the hook)."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
        runtime = knobs.runtime
        prev = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False

    def hook(*, fn=None, repr=None, **kw):
        _record(getattr(fn, "name", None) or str(repr).split("[", 1)[0])
        return prev(fn=fn, repr=repr, **kw) if prev is not None else None

    runtime.jit_post_compile_hook = hook
    _installed = True
    return True


def take() -> list[str]:
    """The kernel names compiled since the last take(), in compile order; clears them."""
    with _lock:
        names = _names[:]
        _names.clear()
    return names


def summary(names: list[str], limit: int = 8) -> str:
    """'none' or 'name x2, other, ...' (each name once with its count, the first `limit` names)."""
    if not names:
        return "none"
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    parts = [f"{n} x{c}" if c > 1 else n for n, c in counts.items()]
    return ", ".join(parts[:limit]) + (f", +{len(parts) - limit} more" if len(parts) > limit else "")


_ALLOC_KEYS = ("segment.all.allocated", "reserved_bytes.all.allocated", "num_alloc_retries")
_alloc_seen: dict[str, int] = {}


def allocator_note(device) -> str:
    """The caching allocator's cudaMalloc calls, the bytes they reserved and its retries since the
    previous call (the engine makes one once its runner is built: the baseline); '' off CUDA."""
    import torch

    if getattr(device, "type", device) != "cuda" or not torch.cuda.is_available():
        return ""
    stats = torch.cuda.memory_stats(device)
    now = {k: int(stats.get(k, 0)) for k in _ALLOC_KEYS}
    d = {k: now[k] - _alloc_seen.get(k, 0) for k in _ALLOC_KEYS}
    _alloc_seen.update(now)
    gib = d["reserved_bytes.all.allocated"] / 2**30
    return (f"cudaMalloc +{d['segment.all.allocated']}, {gib:.1f} GiB reserved, "
            f"allocator retries +{d['num_alloc_retries']}")
