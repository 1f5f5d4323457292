"""Text stage: the CLIP text transformer (causal, pre-norm) and the projection to the detector's width.

input_ids, valid: [P, T] (T <= config.text_context; valid True on real tokens, right padding) ->
prompt features [P, T, hidden]. Padded positions carry values but are masked wherever they are read.
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer.sam.config import SamConfig
from metainfer.sam.layers import MLP, Attention


class ClipLayer(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        d = config.text_hidden
        self.self_attn = Attention(d, config.text_heads, out_name="out_proj")
        self.layer_norm1 = nn.LayerNorm(d, eps=config.text_eps)
        self.mlp = MLP(d, config.text_intermediate, config.text_act)
        self.layer_norm2 = nn.LayerNorm(d, eps=config.text_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.layer_norm1(x)
        x = x + self.self_attn(y, y, y, mask)
        return x + self.mlp(self.layer_norm2(x))


class ClipEmbeddings(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.text_hidden)
        self.position_embedding = nn.Embedding(config.text_context, config.text_hidden)


class ClipEncoder(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipLayer(config) for _ in range(config.text_layers))


class ClipTextModel(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.embeddings = ClipEmbeddings(config)
        self.encoder = ClipEncoder(config)
        self.final_layer_norm = nn.LayerNorm(config.text_hidden, eps=config.text_eps)

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        x = self.embeddings.token_embedding(input_ids) + self.embeddings.position_embedding(pos)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        mask = causal[None, None] & valid[:, None, None, :]  # [P, 1, T, T]; row 0 always sees BOS
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.final_layer_norm(x)


class ClipWithProjection(nn.Module):
    """Holds `text_model` under transformers' names; CLIP's own `text_projection` is not used."""

    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.text_model = ClipTextModel(config)
