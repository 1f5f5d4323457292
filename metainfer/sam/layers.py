"""Building blocks shared by the SAM 3 stages: multi-head attention, MLPs, activations, sine positions.

Attention masks follow one convention: a bool mask is True where a key may be attended, a float mask is
added to the scores; either broadcasts to [B, heads, Q, K].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def activation(name: str):
    if name == "gelu":
        return F.gelu
    if name == "relu":
        return F.relu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise ValueError(f"unknown activation {name!r}")


class Attention(nn.Module):
    """Multi-head attention with separate q/k/v/o projections (all with bias)."""

    def __init__(self, dim: int, heads: int, out_name: str = "o_proj") -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_name = out_name
        setattr(self, out_name, nn.Linear(dim, dim))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        # [B, L, D] -> [B, heads, L, head_dim]
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        # q: [B, Q, D]; k, v: [B, K, D] -> [B, Q, D]
        o = F.scaled_dot_product_attention(
            self.split(self.q_proj(q)), self.split(self.k_proj(k)), self.split(self.v_proj(v)), attn_mask=mask
        )
        return getattr(self, self.out_name)(o.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """fc1 -> activation -> fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class HeadMLP(nn.Module):
    """2 or 3 linear layers with ReLU between them (`layer1..layer3`)."""

    def __init__(self, dim_in: int, hidden: int, dim_out: int, num_layers: int) -> None:
        super().__init__()
        if num_layers not in (2, 3):
            raise ValueError("HeadMLP has 2 or 3 layers")
        self.layer1 = nn.Linear(dim_in, hidden)
        self.layer2 = nn.Linear(hidden, hidden if num_layers == 3 else dim_out)
        self.layer3 = nn.Linear(hidden, dim_out) if num_layers == 3 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(F.relu(self.layer1(x)))
        if self.layer3 is not None:
            x = self.layer3(F.relu(x))
        return x


def key_mask(valid: torch.Tensor | None) -> torch.Tensor | None:
    """[B, K] bool (True = real token) -> [B, 1, 1, K] attention mask; None stays None."""
    return None if valid is None else valid[:, None, None, :]


def sine_terms(x: torch.Tensor, num_feats: int, temperature: float = 10000.0) -> torch.Tensor:
    """x: [...] -> [..., num_feats]: sin at even, cos at odd feature i of
    x / temperature^(2*(i//2)/num_feats)."""
    i = torch.arange(num_feats, device=x.device, dtype=torch.int64).to(x.dtype)
    dim_t = temperature ** (2 * torch.div(i, 2, rounding_mode="floor") / num_feats)
    p = x[..., None] / dim_t
    return torch.stack((p[..., 0::2].sin(), p[..., 1::2].cos()), dim=-1).flatten(-2)


def grid_sine_embedding(height: int, width: int, channels: int, device, dtype) -> torch.Tensor:
    """Normalised 2-D sine positions of a feature map: [channels, height, width], y features then x."""
    half, eps, scale = channels // 2, 1e-6, 2 * math.pi
    y = torch.arange(1, height + 1, device=device, dtype=dtype)
    x = torch.arange(1, width + 1, device=device, dtype=dtype)
    y = y / (y[-1] + eps) * scale
    x = x / (x[-1] + eps) * scale
    py = sine_terms(y, half)[:, None, :].expand(height, width, half)  # [H, W, half]
    px = sine_terms(x, half)[None, :, :].expand(height, width, half)
    return torch.cat((py, px), dim=-1).permute(2, 0, 1)


def box_sine_embedding(boxes: torch.Tensor, num_feats: int) -> torch.Tensor:
    """boxes [B, Q, 4] as (cx, cy, w, h) in [0, 1] -> [B, Q, 4 * num_feats], ordered (cy, cx, w, h)."""
    scaled = boxes * (2 * math.pi)
    cx, cy, w, h = (sine_terms(scaled[..., i], num_feats) for i in range(4))
    return torch.cat((cy, cx, w, h), dim=-1)


def inverse_sigmoid(x: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    x = x.clamp(0, 1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def cxcywh_to_xyxy(b: torch.Tensor) -> torch.Tensor:
    cx, cy, w, h = b.unbind(-1)
    return torch.stack((cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h), dim=-1)
