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


@dataclass(frozen=True)
class PendingNorm:
    """A decode token's input RMSNorm not yet applied: norm(sum of `rows` + residual), left to the
    projection that takes it as its x prologue (`Linear.forward`, `Linear.conv_forward`: cuda/gemv.cu)
    or computed by `materialize` where none does. new_res receives the new residual (sum + residual)
    either way."""

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

    def materialize(self) -> torch.Tensor:
        return ops.moe_add_rms_norm(self.rows.rows, self.rows.weights, self.residual, self.weight, self.eps,
                                    self.rows.dtype, res_out=self.new_res)[0]


def fp8_copy_buffers(consumer: Linear | bool, T: int, K: int, device, norm_op: str = "add_rms_norm"
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Buffers for a norm's e4m3 copy of its [T, K] output, where the consumer (a Linear with FP8
    weights, or True) would quantise the same rows itself (T past the weight-streaming bound, the
    cuBLAS / grouped e4m3 GEMMs) and the norm's kernel runs (`ops.norm_quant_buffers`); else None."""
    fp8 = consumer if isinstance(consumer, bool) else consumer.weight_scale_inv is not None
    return ops.norm_quant_buffers(T, K, device, norm_op) if fp8 else None


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
        e4m3 copy (`fp8_copy_buffers`; the norm kernels only)."""
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
        `PendingNorm`: its norm in the projection's prologue where a kernel takes it."""
        if isinstance(x, PendingNorm):
            y = ops.pending_norm_linear(*x.operands(), self.weight, self.weight_scale_inv)
            if y is not None:
                return y
            x = x.materialize()
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
            y = ops.pending_norm_linear(*x.operands(), self.weight, self.weight_scale_inv,
                                        conv=(conv_weight, conv_state, slots, has_state))
            if y is not None:
                return y
            x = x.materialize()
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

    def takes_fp8_input(self, T: int) -> bool:
        """Whether a step of T tokens runs the grouped e4m3 x e4m3 experts (which take x's e4m3 copy)."""
        fp8 = self.w_gate_up_scale is not None
        return fp8 and self.fused_shared and ops.moe_takes_fp8_input(T, fp8)

    def norm_and_route(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`norm.add_forward(x, residual)` and this block's router logits of its output in one launch
        (`ops.add_rms_norm_router`: a decode step's few tokens, unquantised router): -> (normed,
        new residual, logits [T, E+1]), or None (then the norm, and `forward` runs the router)."""
        if self.router.weight_scale_inv is not None:
            return None
        return ops.add_rms_norm_router(x, residual, norm.weight, norm.eps, self.router.weight)

    def forward(
        self, x: torch.Tensor, xq: tuple[torch.Tensor, torch.Tensor] | None = None,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor | ExpertRows:  # [T, H] -> [T, H]
        """Decode batches on the GPU kernels return `ExpertRows` (summed by the next norm). xq: x's
        e4m3 copy from its norm, taken by the grouped FP8 experts; logits: the router's output for x
        where `norm_and_route` computed it."""
        scales = (self.w_gate_up_scale, self.w_down_scale)
        if logits is None:
            logits = self.router(x)  # [T, E+1]
        if self.fused_shared:
            part = ops.moe_routed_rows(x, logits, self.top_k, True, self.w_gate_up, self.w_down, *scales)
            if part is None:  # the route launch, then the experts; the sum still in the next norm
                part = ops.moe_rows(x, logits, self.top_k, self.w_gate_up, self.w_down, *scales, xq=xq)
            if part is not None:
                return ExpertRows(*part, x.dtype)
            weights, ids = ops.route_with_shared(logits, self.top_k)  # [T, k+1]
            return ops.moe_experts(x, self.w_gate_up, self.w_down, weights, ids, *scales)
        weights, ids = ops.route(logits[:, : self.num_experts], self.top_k)
        routed = ops.moe_experts(x, self.w_gate_up, self.w_down, weights, ids, *scales)
        gate, up = self.shared_gate_up.split(self.shared_gate_up(x))
        shared = self.shared_down(F.silu(gate) * up)
        return routed + torch.sigmoid(logits[:, self.num_experts :]) * shared
