"""Programmatic dependent launch (PDL, sm_90+): each kernel of a decode step may be launched while
the one before it is still running, so its launch and CTA start-up hide behind that kernel's tail.

The contract, kept by every Triton kernel in this package: it calls `wait(USE_PDL)`, which blocks
until every earlier kernel on the stream has finished and its writes are visible
(`griddepcontrol.wait`), and only then lets the next kernel launch (`launch_dependents`). So at
most one kernel runs ahead, and before its wait it touches no memory but the model's weights
(or what READ_BEFORE_WAIT names for it: memory its predecessor does not write): no read of an output
not yet written, no write over an input still being read (tests/kernels/test_pdl.py checks the
kernels' source). The exception, behind a switch: a kernel of EARLY_KERNELS may release the next one
at its start (`release`; KB-0112 measured it slower for the attention reduce). Most kernels wait
first; `weight_stream._gemv_kernel` loads its weight tile first, so the bytes stream while the
previous kernel runs. Kernels from elsewhere (cuBLAS, torch) are
launched without the attribute and serialise as usual; a PDL kernel after one of them waits for
it to complete. CUDA-graph capture records the programmatic edges.

Off on the interpreter, before sm_90, when Triton lacks the intrinsics, or with METAINFER_PDL=0.
Measured on the H200 (batch-1 decode): FP8 371 -> 412 tok/s, BF16 317 -> 351 (KB-0009); an L2
bulk prefetch of each program's weight rows before the wait made it slower (398, 346) and was
dropped (KB-0010).
"""

from __future__ import annotations

import contextlib
import os

import triton
import triton.language as tl

ENV = "METAINFER_PDL"
PREFILL_ENV = "METAINFER_PDL_PREFILL"  # "1": prefill chunks launch with PDL too (default: `off_for`, KB-0049)
PREFILL_MAX_TOKENS = 16  # with it "0", a step whose longest chunk is longer launches without PDL
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
    return (_SUSPENDED == 0 and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and os.environ.get(ENV, "1") != "0" and _supported())


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
    launch gains nothing before kernels of 100+ us and its CTAs hold SMs while they wait. A 1k
    prefill's TTFT on the H200: FP8 25.9-26.0 -> 25.4 ms, BF16 32.2 -> 31.6 (KB-0049).
    METAINFER_PDL_PREFILL=1 keeps PDL for prefill too."""
    return suspended(max_chunk > PREFILL_MAX_TOKENS and os.environ.get(PREFILL_ENV, "0") != "1")


def kw() -> dict:
    """Launch keyword arguments: {USE_PDL: 1, launch_pdl: True} when enabled, else {}."""
    return {"USE_PDL": 1, "launch_pdl": True} if enabled() else {}


# may release the next kernel at their start: (switch, its default) each (`early`)
EARLY_KERNELS = {
    # the next: the qkv / in_proj (its weights); on: FP8 batch 1 601.7 -> 614.7 tok/s, same tokens, oracle
    # not yet run (KB-0118: off until it passes)
    "_routed_down_kernel": ("METAINFER_MOE_DOWN_EARLY", "0"),
    "_add_rms_norm_router_kernel": ("METAINFER_ROUTER_EARLY", "0"),  # the experts' gate/up (the shared's)
    "_gdn_decode_kernel": ("METAINFER_GDN_EARLY", "0"),  # the out_proj (its weights)
}


def early(kernel: str) -> int:
    """The EARLY constexpr of a kernel of EARLY_KERNELS: 1 where its switch (or its default) is "1" and PDL
    is on."""
    env, default = EARLY_KERNELS[kernel]
    return int(os.environ.get(env, default) == "1" and enabled())


@triton.jit
def release(USE_PDL: tl.constexpr, EARLY: tl.constexpr):
    """(EARLY; first statement of the kernels of EARLY_KERNELS only) the next kernel released at this one's
    start, so that its CTAs may come in and stream their weights while the kernel before this one still runs:
    two kernels ahead, not one. Only where every kernel that can follow touches nothing before its own wait
    that the kernel before this one writes (weights, the DeltaNet states, or a kernel that waits first; not
    the experts' gate/up, whose down reads the router's logits before its wait); its wait still waits for this
    kernel, and this kernel's for the one before. KB-0112 measured it slower for the attention reduce (the
    o_proj's preload beside the split kernel)."""
    if USE_PDL and EARLY:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(USE_PDL: tl.constexpr):
    """First statement of every kernel: wait for the previous kernel, then release the next."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
