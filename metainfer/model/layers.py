"""Building blocks: norms, (merged) linear layers, rotary embedding, the sparse MoE block."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metainfer.config import ModelConfig
from metainfer.kernels import ops


@dataclass(frozen=True)
class ExpertRows:
    """A MoE block's output before its weighted sum: rows [T, W, H] (one per token and slot; fp32 from
    the per-pair decode kernels, the model dtype from the grouped ones), weights [T, W] fp32; the
    sum, rounded to `dtype`, is the block's output. The next `RMSNorm.add_forward` takes it as x
    and sums it in the same launch as the residual add."""

    rows: torch.Tensor
    weights: torch.Tensor
    dtype: torch.dtype

    def value(self) -> torch.Tensor:
        """The block's output [T, H] as its own tensor (the weighted sum in fp32, rounded to `dtype`); for
        observers such as the oracle's layer hook, never on the serving path."""
        return (self.rows.float() * self.weights[..., None]).sum(1).to(self.dtype)


@dataclass(frozen=True)
class PendingNorm:
    """A decode token's input RMSNorm not yet applied: norm(sum of `rows` + residual), left to the
    projection that takes it (`Linear.forward`, `Linear.conv_forward`: `ops.pending_norm_linear`, the
    plan's input_norm "prologue"). new_res receives the new residual (sum + residual)."""

    rows: ExpertRows
    residual: torch.Tensor  # [1, H]
    weight: torch.Tensor  # the norm's
    eps: float
    new_res: torch.Tensor  # [1, H]

    @property
    def shape(self) -> torch.Size:
        return self.residual.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.residual.dtype

    @property
    def device(self) -> torch.device:
        return self.residual.device

    def operands(self) -> tuple:
        return (self.rows.rows, self.rows.weights, self.residual, self.weight, self.eps, self.new_res)


class RMSNorm(nn.Module):
    """x / rms(x) * (1 + w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor | ExpertRows, residual: torch.Tensor | None,
        xq_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one pass; xq_out: buffers that also get the output's
        e4m3 copy (`ops.act_buffers`, a plan's "copy": the norm kernels only)."""
        if isinstance(x, ExpertRows):
            return ops.moe_add_rms_norm(x.rows, x.weights, residual, self.weight, self.eps, x.dtype,
                                        xq_out=xq_out)
        return ops.add_rms_norm(x, residual, self.weight, self.eps, xq_out=xq_out)


class Linear(nn.Module):
    """y = x W^T with W [out, in], bias-free. Rows may be several checkpoint tensors stacked
    (`parts`: checkpoint-name suffix -> row count), split again by `split()` after the matmul.

    FP8: `weight` is e4m3 and `weight_scale_inv` [ceil(out/128), ceil(in/128)] holds the block scales.
    """

    def __init__(self, in_features: int, parts: dict[str, int]) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts = dict(parts)
        self.out_features = sum(parts.values())
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.weight_scale_inv: torch.Tensor | None = None

    def row_offset(self, part: str) -> tuple[int, int]:
        off = 0
        for name, n in self.parts.items():
            if name == part:
                return off, n
            off += n
        raise KeyError(part)

    def forward(self, x: torch.Tensor | PendingNorm, xq: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """xq: x's e4m3 copy from its norm (FP8 weights; an optional shortcut, the same operands). x
        `PendingNorm`: its norm and this projection in one op (FP8 weights)."""
        if isinstance(x, PendingNorm):
            return ops.pending_norm_linear(*x.operands(), self.weight, self.weight_scale_inv,
                                           dtype=x.rows.dtype)
        if self.weight_scale_inv is not None:
            return ops.fp8_linear(x, self.weight, self.weight_scale_inv, xq=xq)
        return ops.linear(x, self.weight)

    def conv_forward(
        self, x: torch.Tensor | PendingNorm, conv_weight: torch.Tensor, conv_state: torch.Tensor,
        slots: torch.Tensor, has_state: torch.Tensor,
    ) -> torch.Tensor:
        """forward(x) with the DeltaNet decode conv + SiLU applied to the first C = conv channels of
        the first len(slots) rows (their conv states updated in place); on the GPU kernels it is the
        projection kernel's epilogue (and a `PendingNorm` x's norm its prologue where one takes it)."""
        if isinstance(x, PendingNorm):
            return ops.pending_norm_linear(*x.operands(), self.weight, self.weight_scale_inv,
                                           conv=(conv_weight, conv_state, slots, has_state),
                                           dtype=x.rows.dtype)
        return ops.linear_conv_update(x, self.weight, self.weight_scale_inv, conv_weight, conv_state, slots,
                                      has_state)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, list(self.parts.values()), dim=-1)


class Rotary(nn.Module):
    """Partial NeoX RoPE on the first `rotary_dim` dims (mrope collapses to this for text)."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", ops.rope_inv_freq(rotary_dim, theta), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return ops.apply_rope(x, positions, self.inv_freq)


class SparseMoE(nn.Module):
    """Top-k of E experts (fp32 softmax, renormalised) plus a sigmoid-gated shared expert.

    The router and the shared-expert gate are one [E+1, H] matrix: logits[:, :E] route,
    logits[:, E] gates the shared expert. When the shared expert has the experts' size it is
    stored as expert E and runs in the same kernel as a (k+1)-th slot of weight sigmoid(logit E).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        Is = cfg.shared_expert_intermediate_size
        self.num_experts, self.top_k = E, cfg.num_experts_per_tok
        self.fused_shared = Is == I
        n = E + 1 if self.fused_shared else E
        self.router = Linear(H, {"gate": E, "shared_expert_gate": 1})
        self.w_gate_up = nn.Parameter(torch.empty(n, 2 * I, H), requires_grad=False)  # [E(+1), 2I, H]
        self.w_down = nn.Parameter(torch.empty(n, H, I), requires_grad=False)  # [E(+1), H, I]
        self.w_gate_up_scale: torch.Tensor | None = None  # FP8 block scales
        self.w_down_scale: torch.Tensor | None = None
        if not self.fused_shared:
            self.shared_gate_up = Linear(H, {"gate_proj": Is, "up_proj": Is})
            self.shared_down = Linear(Is, {"down_proj": H})

    def forward(
        self, x: torch.Tensor, path: str, xq: tuple[torch.Tensor, torch.Tensor] | None = None,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor | ExpertRows:  # [T, H] -> [T, H]
        """path: the step plan's `moe`; its "*_rows" paths return `ExpertRows` (summed by the next norm).
        xq: x's e4m3 copy from its norm, taken by the grouped FP8 experts; logits: the router's output
        for x where its norm computed it (the plan's moe_norm "router")."""
        scales = (self.w_gate_up_scale, self.w_down_scale)
        if logits is None:
            logits = self.router(x)  # [T, E+1]
        if path == "routed_rows":
            return ExpertRows(*ops.moe_routed_rows(x, logits, self.top_k, True, self.w_gate_up, self.w_down,
                                                   *scales), x.dtype)
        if path == "pair_rows":
            return ExpertRows(*ops.moe_pair_rows(x, logits, self.top_k, self.w_gate_up, self.w_down, *scales),
                              x.dtype)
        if path == "grouped_rows":
            return ExpertRows(*ops.moe_grouped_rows(x, logits, self.top_k, self.w_gate_up, self.w_down,
                                                    *scales, xq=xq), x.dtype)
        if self.fused_shared:
            weights, ids = ops.route_with_shared(logits, self.top_k)  # [T, k+1]
            return ops.moe_experts(x, self.w_gate_up, self.w_down, weights, ids, *scales)
        weights, ids = ops.route(logits[:, : self.num_experts], self.top_k)
        routed = ops.moe_experts(x, self.w_gate_up, self.w_down, weights, ids, *scales)
        gate, up = self.shared_gate_up.split(self.shared_gate_up(x))
        shared = self.shared_down(F.silu(gate) * up)
        return routed + torch.sigmoid(logits[:, self.num_experts :]) * shared
