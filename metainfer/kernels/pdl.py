"""Programmatic dependent launch (PDL, sm_90+): each kernel of a decode step may be launched while
the one before it is still running, so its launch and CTA start-up hide behind that kernel's tail.

The contract, kept by every Triton kernel in this package: it calls `wait(USE_PDL)`, which blocks
until every earlier kernel on the stream has finished and its writes are visible
(`griddepcontrol.wait`), and only then lets the next kernel launch (`launch_dependents`). So at
most one kernel runs ahead, and before its wait it touches no memory but the model's weights
(or what READ_BEFORE_WAIT names for it: memory its predecessor does not write): no read of an output
not yet written, no write over an input still being read (tests/kernels/test_pdl.py checks the
kernels' source). Most kernels wait first; `weight_stream._gemv_kernel` loads its weight tile first,
so the bytes stream while the previous kernel runs. Kernels from elsewhere (cuBLAS, torch) are
launched without the attribute and serialise as usual; a PDL kernel after one of them waits for
it to complete. CUDA-graph capture records the programmatic edges.

Off on the interpreter, before sm_90, when Triton lacks the intrinsics, or with METAINFER_PDL=0
(`settings.pdl`).
"""

from __future__ import annotations

import contextlib

import triton
import triton.language as tl

from metainfer.settings import settings

PREFILL_MAX_TOKENS = 16  # a step whose longest chunk is longer launches without PDL (`off_for`)
# What a kernel may load before its wait, by kernel: memory its predecessor (the only kernel that
# can still be running) does not write. Weights are never written during a step; the DeltaNet
# states are written by their own decode kernel only, and the slot inputs by the step's first copies.
READ_BEFORE_WAIT = {
    "_gemv_kernel": frozenset({"weight_ptr", "wscale_ptr"}),
    "_gdn_decode_kernel": frozenset({"state_ptr", "slots_ptr", "has_ptr"}),
    "_add_rms_norm_router_kernel": frozenset({"rw_ptr"}),  # the MoE router's weight
    "_gnorm_gemv_kernel": frozenset({"weight_ptr", "wscale_ptr"}),
    # the router's logits, or (FP8 `moe_pair_rows`) the route launch's ids: written two kernels
    # back (the router or the route kernel; the gate/up kernel is between)
    "_routed_down_kernel": frozenset({"w_ptr", "s_ptr", "logits_ptr"}),
}
_SUPPORTED: bool | None = None


def _supported() -> bool:
    global _SUPPORTED
    if _SUPPORTED is None:
        try:
            import torch

            _SUPPORTED = (
                torch.cuda.is_available()
                and torch.cuda.get_device_capability()[0] >= 9
                and hasattr(tl.extra.cuda, "gdc_wait")
                and hasattr(tl.extra.cuda, "gdc_launch_dependents")
            )
        except Exception:  # no driver, an old Triton
            _SUPPORTED = False
    return _SUPPORTED


_SUSPENDED = 0  # depth of `suspended` contexts


def enabled() -> bool:
    s = settings()
    return _SUSPENDED == 0 and not s.triton_interpret and s.pdl and _supported()


@contextlib.contextmanager
def suspended(on: bool = True):
    """Launches inside (and CUDA graphs captured inside) go without PDL when `on`."""
    global _SUSPENDED
    _SUSPENDED += int(on)
    try:
        yield
    finally:
        _SUSPENDED -= int(on)


def off_for(max_chunk: int):
    """`suspended` for a step whose longest chunk has max_chunk tokens: prefill chunks longer than
    PREFILL_MAX_TOKENS launch without PDL (decode steps and short verify chunks keep it); an early
    launch gains nothing before long kernels and its CTAs hold SMs while they wait."""
    return suspended(max_chunk > PREFILL_MAX_TOKENS)


def kw() -> dict:
    """Launch keyword arguments: {USE_PDL: 1, launch_pdl: True} when enabled, else {}."""
    return {"USE_PDL": 1, "launch_pdl": True} if enabled() else {}


@triton.jit
def wait(USE_PDL: tl.constexpr):
    """First statement of every kernel: wait for the previous kernel, then release the next."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
