"""Maps op names (see `ops.py`) to Triton launchers. Each launcher has exactly the signature of
the op it replaces and is tested against the reference in tests/kernels. A module that is absent
or fails to import (no Triton) simply leaves its ops on the reference path."""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger("metainfer.kernels")

# op name -> (module, function)
KERNELS: dict[str, tuple[str, str]] = {
    "rms_norm": ("metainfer.kernels.norm", "rms_norm"),
    "add_rms_norm": ("metainfer.kernels.norm", "add_rms_norm"),
    "gated_rms_norm": ("metainfer.kernels.norm", "gated_rms_norm"),
    "causal_conv1d_update": ("metainfer.kernels.conv1d", "causal_conv1d_update"),
    "causal_conv1d": ("metainfer.kernels.conv1d", "causal_conv1d"),
    "gdn_decode": ("metainfer.kernels.gdn_decode", "gdn_decode"),
    "gdn_decode_gated": ("metainfer.kernels.gdn_decode", "gdn_decode_gated"),
    "gdn_prefill_varlen": ("metainfer.kernels.gdn_prefill", "gdn_prefill_varlen"),
    "paged_attention": ("metainfer.kernels.attention", "paged_attention"),
    "qk_norm_rope_write": ("metainfer.kernels.qk_norm_rope", "qk_norm_rope_write"),
    "route": ("metainfer.kernels.routing", "route_topk"),
    "moe_experts": ("metainfer.kernels.moe", "moe_experts"),
    "moe_routed_rows": ("metainfer.kernels.moe", "moe_routed_rows"),
    "moe_add_rms_norm": ("metainfer.kernels.norm", "moe_add_rms_norm"),
    "add_rms_norm_router": ("metainfer.kernels.norm", "add_rms_norm_router"),
    "moe_pair_rows": ("metainfer.kernels.moe", "moe_pair_rows"),
    "moe_grouped_rows": ("metainfer.kernels.moe", "moe_grouped_rows"),
    "fp8_linear": ("metainfer.kernels.fp8_linear", "fp8_linear"),
    "linear": ("metainfer.kernels.weight_stream", "dense_linear"),
    "linear_conv_update": ("metainfer.kernels.fp8_linear", "linear_conv_update"),
    "gated_norm_linear": ("metainfer.kernels.weight_stream", "gated_norm_linear"),
    "pending_norm_linear": ("metainfer.kernels.cuda.gemv", "project_pre"),
    "decode_inputs": ("metainfer.kernels.decode_io", "decode_inputs"),
    "argmax_rows": ("metainfer.kernels.decode_io", "argmax_rows"),
}


def load(only: set[str] | None = None) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, (mod, fn) in KERNELS.items():
        if only is not None and name not in only:
            continue
        try:
            out[name] = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            log.info("kernel %s unavailable (%s); using the reference", name, e)
    return out
