"""Vision stage: ViT backbone (windowed + global attention, 2-D axial RoPE) and the feature pyramid.

Input pixel_values [B, 3, S, S] with S = config.image_size; output: the pyramid levels used by the
detector, [B, hidden, g*4, g*4], [B, hidden, g*2, g*2], [B, hidden, g, g] (g = S / patch), and their sine
position embeddings [hidden, h, w] (the same for every image).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metainfer.sam.config import SamConfig
from metainfer.sam.layers import MLP, grid_sine_embedding


def rope_angles(config: SamConfig, side: int, position_scale: float) -> torch.Tensor:
    """Angles of the axial RoPE on a side × side grid: [side*side, head_dim], each angle repeated for its
    (even, odd) pair; the first half rotates by the column (x) position, the second by the row (y)."""
    head_dim = config.vision_hidden // config.vision_heads
    quarter = head_dim // 4
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float) / (2 * quarter))
    )
    rows, cols = torch.meshgrid(
        torch.arange(side, dtype=torch.float), torch.arange(side, dtype=torch.float), indexing="ij"
    )
    x = cols.flatten() * position_scale  # [N]
    y = rows.flatten() * position_scale
    ang = torch.cat((x[:, None] * inv_freq, y[:, None] * inv_freq), dim=-1)  # [N, head_dim / 2]
    return ang.repeat_interleave(2, dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., N, head_dim] rotated pairwise: (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin), in fp32."""
    xf = x.float()
    pairs = xf.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (xf * cos.float() + rotated * sin.float()).to(x.dtype)


class RopeAttention(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        d = config.vision_hidden
        self.heads = config.vision_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.o_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [B', h, w, D] (B' = images × windows); cos, sin: [h*w, head_dim]
        b, h, w, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, h * w, self.heads, d // self.heads).transpose(1, 2)  # [B', heads, N, hd]

        q = apply_rope(split(self.q_proj(x)), cos, sin)
        k = apply_rope(split(self.k_proj(x)), cos, sin)
        o = F.scaled_dot_product_attention(q, k, split(self.v_proj(x)))
        return self.o_proj(o.transpose(1, 2).reshape(b, h, w, d))


def to_windows(x: torch.Tensor, win: int) -> tuple[torch.Tensor, int, int]:
    """[B, H, W, D] -> [B * nh * nw, win, win, D], zero-padded at the bottom/right to whole windows."""
    b, h, w, d = x.shape
    ph, pw = -h % win, -w % win
    x = F.pad(x, (0, 0, 0, pw, 0, ph))
    nh, nw = (h + ph) // win, (w + pw) // win
    x = x.view(b, nh, win, nw, win, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b * nh * nw, win, win, d), nh, nw


def from_windows(x: torch.Tensor, nh: int, nw: int, h: int, w: int) -> torch.Tensor:
    """Inverse of `to_windows`: [B * nh * nw, win, win, D] -> [B, h, w, D]."""
    win, d = x.shape[1], x.shape[-1]
    b = x.shape[0] // (nh * nw)
    x = x.view(b, nh, nw, win, win, d).permute(0, 1, 3, 2, 4, 5).reshape(b, nh * win, nw * win, d)
    return x[:, :h, :w]


class VitLayer(nn.Module):
    def __init__(self, config: SamConfig, window: int) -> None:
        super().__init__()
        d = config.vision_hidden
        self.window = window  # 0: global attention over the whole grid
        self.layer_norm1 = nn.LayerNorm(d, eps=config.vision_eps)
        self.attention = RopeAttention(config)
        self.layer_norm2 = nn.LayerNorm(d, eps=config.vision_eps)
        self.mlp = MLP(d, config.vision_intermediate, config.vision_act)
        # global layers squeeze the grid's positions into one window's range
        side = window or config.grid
        ang = rope_angles(config, side, 1.0 if window else config.window_size / config.grid)
        self.config = config
        self.register_buffer("rope_cos", ang.cos(), persistent=False)  # [side*side, head_dim]
        self.register_buffer("rope_sin", ang.sin(), persistent=False)

    def init_buffers(self, device: torch.device) -> None:
        """(Re)compute the RoPE tables on `device` (after building on the meta device)."""
        c = self.config
        side = self.window or c.grid
        ang = rope_angles(c, side, 1.0 if self.window else c.window_size / c.grid).to(device)
        self.rope_cos, self.rope_sin = ang.cos(), ang.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, g, g, D]
        b, h, w, _ = x.shape
        y = self.layer_norm1(x)
        if self.window:
            y, nh, nw = to_windows(y, self.window)
            y = from_windows(self.attention(y, self.rope_cos, self.rope_sin), nh, nw, h, w)
        else:
            y = self.attention(y, self.rope_cos, self.rope_sin)
        x = x + y
        return x + self.mlp(self.layer_norm2(x))


class PatchEmbeddings(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.projection = nn.Conv2d(3, config.vision_hidden, kernel_size=p, stride=p, bias=False)


class Embeddings(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.patch_embeddings = PatchEmbeddings(config)
        n = (config.pretrain_image_size // config.patch_size) ** 2
        self.position_embeddings = nn.Parameter(torch.empty(1, n, config.vision_hidden))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # [B, 3, S, S] -> [B, g, g, D]; the pretraining position table is tiled (not interpolated) to g × g
        x = self.patch_embeddings.projection(pixel_values).permute(0, 2, 3, 1)
        g = x.shape[1]
        p = self.position_embeddings
        side = int(round(p.shape[1] ** 0.5))
        table = p.view(1, side, side, -1)
        reps = g // side + 1
        table = table.repeat(1, reps, reps, 1)[:, :g, :g]
        return x + table


class Backbone(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(config)
        self.layer_norm = nn.LayerNorm(config.vision_hidden, eps=config.vision_eps)
        self.layers = nn.ModuleList(
            VitLayer(config, 0 if i in config.global_layers else config.window_size)
            for i in range(config.vision_layers)
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(self.embeddings(pixel_values))  # [B, g, g, D]
        for layer in self.layers:
            x = layer(x)
        return x


class FpnLayer(nn.Module):
    """One pyramid level: resample the [B, D, g, g] grid by `scale`, then 1×1 and 3×3 convolutions."""

    def __init__(self, dim: int, out: int, scale: float) -> None:
        super().__init__()
        self.scale_layers = nn.ModuleList()
        ch = dim
        if scale == 4.0:
            self.scale_layers.extend(
                [
                    nn.ConvTranspose2d(dim, dim // 2, 2, stride=2),
                    nn.GELU(),
                    nn.ConvTranspose2d(dim // 2, dim // 4, 2, stride=2),
                ]
            )
            ch = dim // 4
        elif scale == 2.0:
            self.scale_layers.append(nn.ConvTranspose2d(dim, dim // 2, 2, stride=2))
            ch = dim // 2
        elif scale == 0.5:
            self.scale_layers.append(nn.MaxPool2d(2, stride=2))
        self.proj1 = nn.Conv2d(ch, out, 1)
        self.proj2 = nn.Conv2d(out, out, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.scale_layers:
            x = layer(x)
        return self.proj2(self.proj1(x))


class Neck(nn.Module):
    """The pyramid levels the image path reads: every configured scale but the last (coarsest)."""

    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.fpn_layers = nn.ModuleList(
            FpnLayer(config.vision_hidden, config.fpn_hidden, s) for s in config.scale_factors[:-1]
        )


class VisionEncoder(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.config = config
        self.backbone = Backbone(config)
        self.neck = Neck(config)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """[B, 3, S, S] -> pyramid levels, finest first."""
        s = self.config.image_size
        if pixel_values.shape[-2:] != (s, s):
            raise ValueError(f"pixel_values must be {s}×{s}, got {tuple(pixel_values.shape[-2:])}")
        x = self.backbone(pixel_values).permute(0, 3, 1, 2)  # [B, D, g, g]
        return [layer(x) for layer in self.neck.fpn_layers]


def level_positions(levels: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sine position embeddings [C, h, w] of each pyramid level."""
    return [grid_sine_embedding(f.shape[-2], f.shape[-1], f.shape[1], f.device, f.dtype) for f in levels]
