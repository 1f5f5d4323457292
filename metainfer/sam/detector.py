"""Detector stage: fusion encoder (image tokens × prompt), DETR decoder with a presence token and box
refinement, dot-product scoring, and the mask decoder (pixel decoder + per-query mask embeddings).

Shapes: P = prompts in the batch (each with its own image's features), N = g*g image tokens at the
coarsest used level, Q = num_queries, T = prompt tokens, D = hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metainfer.sam.config import SamConfig
from metainfer.sam.layers import (
    MLP,
    Attention,
    HeadMLP,
    box_sine_embedding,
    cxcywh_to_xyxy,
    inverse_sigmoid,
    key_mask,
)


class EncoderLayer(nn.Module):
    """Pre-norm: self-attention over image tokens (positions on q, k), cross-attention to the prompt, MLP."""

    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        d = config.hidden
        self.layer_norm1 = nn.LayerNorm(d)
        self.self_attn = Attention(d, config.heads)
        self.cross_attn = Attention(d, config.heads)
        self.layer_norm2 = nn.LayerNorm(d)
        self.mlp = MLP(d, config.intermediate, config.detector_act)
        self.layer_norm3 = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, prompt: torch.Tensor, pmask) -> torch.Tensor:
        y = self.layer_norm1(x)
        qk = y + pos
        x = x + self.self_attn(qk, qk, y)
        y = self.layer_norm2(x)
        x = x + self.cross_attn(y, prompt, prompt, pmask)
        return x + self.mlp(self.layer_norm3(x))


class DetrEncoder(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.encoder_layers))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, prompt: torch.Tensor, valid) -> torch.Tensor:
        # x: [P, N, D]; pos: [1 or P, N, D]; prompt: [P, T, D]; valid: [P, T] bool -> [P, N, D]
        pmask = key_mask(valid)
        for layer in self.layers:
            x = layer(x, pos, prompt, pmask)
        return x


class DecoderLayer(nn.Module):
    """Post-norm: self-attention among queries, cross-attention to the prompt, then to the image tokens
    (with the box relative-position bias), MLP."""

    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        d = config.hidden
        self.self_attn = Attention(d, config.heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.text_cross_attn = Attention(d, config.heads)
        self.text_cross_attn_layer_norm = nn.LayerNorm(d)
        self.vision_cross_attn = Attention(d, config.heads)
        self.vision_cross_attn_layer_norm = nn.LayerNorm(d)
        self.mlp = MLP(d, config.intermediate, config.detector_act)
        self.mlp_layer_norm = nn.LayerNorm(d)

    def forward(self, h, qpos, prompt, pmask, img, img_k, bias) -> torch.Tensor:
        # h: [P, 1+Q, D] (presence token first); qpos: [P, 1+Q, D] (zero for the presence token)
        q = h + qpos
        h = self.self_attn_layer_norm(h + self.self_attn(q, q, h))
        h = self.text_cross_attn_layer_norm(h + self.text_cross_attn(h + qpos, prompt, prompt, pmask))
        h = self.vision_cross_attn_layer_norm(h + self.vision_cross_attn(h + qpos, img_k, img, bias))
        return self.mlp_layer_norm(h + self.mlp(h))


@dataclass
class DecoderOutput:
    queries: torch.Tensor  # [P, Q, D] last layer's queries after the output norm
    boxes: torch.Tensor  # [P, Q, 4] (cx, cy, w, h) in [0, 1]
    presence_logits: torch.Tensor  # [P, 1]


class DetrDecoder(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        d, self.heads = config.hidden, config.heads
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.decoder_layers))
        self.output_layer_norm = nn.LayerNorm(d)
        self.box_head = HeadMLP(d, d, 4, 3)
        self.query_embed = nn.Embedding(config.num_queries, d)
        self.reference_points = nn.Embedding(config.num_queries, 4)
        self.presence_token = nn.Embedding(1, d)
        self.presence_head = HeadMLP(d, d, 1, 3)
        self.presence_layer_norm = nn.LayerNorm(d)
        self.ref_point_head = HeadMLP(2 * d, d, d, 2)
        self.box_rpb_embed_x = HeadMLP(2, d, config.heads, 2)
        self.box_rpb_embed_y = HeadMLP(2, d, config.heads, 2)

    def box_bias(self, boxes: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Relative-position bias of image token (y, x) for each query's box: [P, heads, 1+Q, h*w],
        zero on the presence token's row."""
        xyxy = cxcywh_to_xyxy(boxes)  # [P, Q, 4]
        ys = torch.arange(h, device=boxes.device, dtype=boxes.dtype) / h
        xs = torch.arange(w, device=boxes.device, dtype=boxes.dtype) / w
        dy = ys[None, None, :, None] - xyxy[:, :, None, 1::2]  # [P, Q, h, 2]: to top, bottom edges
        dx = xs[None, None, :, None] - xyxy[:, :, None, 0::2]  # [P, Q, w, 2]: to left, right edges

        def log_scale(t: torch.Tensor) -> torch.Tensor:
            t = t * 8
            return torch.sign(t) * torch.log2(t.abs() + 1.0) / math.log2(8)

        by = self.box_rpb_embed_y(log_scale(dy))  # [P, Q, h, heads]
        bx = self.box_rpb_embed_x(log_scale(dx))  # [P, Q, w, heads]
        bias = (by[:, :, :, None, :] + bx[:, :, None, :, :]).flatten(2, 3)  # [P, Q, h*w, heads]
        return F.pad(bias.permute(0, 3, 1, 2), (0, 0, 1, 0))

    def forward(self, img, img_pos, hw: tuple[int, int], prompt, valid) -> DecoderOutput:
        # img: [P, N, D] encoder output; img_pos: [1 or P, N, D]; prompt: [P, T, D]
        p = img.shape[0]
        h = torch.cat((self.presence_token.weight, self.query_embed.weight))[None].expand(p, -1, -1)
        boxes = self.reference_points.weight.sigmoid()[None].expand(p, -1, -1)  # [P, Q, 4]
        pmask = key_mask(valid)
        img_k = img + img_pos
        presence = queries = None
        for layer in self.layers:
            qpos = self.ref_point_head(box_sine_embedding(boxes, h.shape[-1] // 2))  # [P, Q, D]
            qpos = F.pad(qpos, (0, 0, 1, 0))
            h = layer(h, qpos, prompt, pmask, img, img_k, self.box_bias(boxes, *hw))
            queries = self.output_layer_norm(h[:, 1:])
            boxes = (self.box_head(queries) + inverse_sigmoid(boxes)).sigmoid()
            presence = self.presence_head(self.presence_layer_norm(h[:, :1])).squeeze(-1).clamp(-10.0, 10.0)
        return DecoderOutput(queries=queries, boxes=boxes, presence_logits=presence)


class DotProductScoring(nn.Module):
    """Query logit = <query_proj(query), text_proj(masked mean of the refined prompt)> / sqrt(D), clamped."""

    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        d = config.hidden
        self.text_mlp = HeadMLP(d, config.intermediate, d, 2)
        self.text_mlp_out_norm = nn.LayerNorm(d)
        self.text_proj = nn.Linear(d, d)
        self.query_proj = nn.Linear(d, d)
        self.scale = 1.0 / math.sqrt(d)

    def forward(self, queries: torch.Tensor, prompt: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        # queries [P, Q, D], prompt [P, T, D], valid [P, T] -> logits [P, Q]
        t = self.text_mlp_out_norm(self.text_mlp(prompt) + prompt)
        w = valid.to(t.dtype)[..., None]
        pooled = (t * w).sum(1) / w.sum(1).clamp(min=1.0)  # [P, D]
        logits = (self.query_proj(queries) @ self.text_proj(pooled)[..., None]).squeeze(-1) * self.scale
        return logits.clamp(-12.0, 12.0)


class PixelDecoder(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        d, n = config.hidden, config.upsampling_stages
        self.conv_layers = nn.ModuleList(nn.Conv2d(d, d, 3, padding=1) for _ in range(n))
        self.norms = nn.ModuleList(nn.GroupNorm(8, d) for _ in range(n))

    def forward(self, levels: list[torch.Tensor]) -> torch.Tensor:
        # levels finest first, [P, D, h_i, w_i] -> [P, D, h_0, w_0]
        x = levels[-1]
        for i, skip in enumerate(reversed(levels[:-1])):
            x = F.interpolate(x, size=skip.shape[-2:], mode="nearest") + skip
            x = F.relu(self.norms[i](self.conv_layers[i](x)))
        return x


class MaskEmbedder(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        d = config.hidden
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class MaskDecoder(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        d = config.hidden
        self.pixel_decoder = PixelDecoder(config)
        self.mask_embedder = MaskEmbedder(config)
        self.instance_projection = nn.Conv2d(d, d, 1)
        self.prompt_cross_attn = Attention(d, config.mask_heads)
        self.prompt_cross_attn_norm = nn.LayerNorm(d)

    def forward(self, queries, levels: list[torch.Tensor], img: torch.Tensor, prompt, valid) -> torch.Tensor:
        """queries [P, Q, D]; levels: the pyramid (finest first) per prompt, the last replaced by the
        encoder output img [P, N, D] after one more cross-attention to the prompt
        -> mask logits [P, Q, h0, w0]."""
        img = img + self.prompt_cross_attn(self.prompt_cross_attn_norm(img), prompt, prompt, key_mask(valid))
        h, w = levels[-1].shape[-2:]
        coarse = img.transpose(1, 2).reshape(img.shape[0], img.shape[2], h, w)
        pixels = self.instance_projection(self.pixel_decoder([*levels[:-1], coarse]))  # [P, D, h0, w0]
        return torch.einsum("pqc,pchw->pqhw", self.mask_embedder(queries), pixels)
