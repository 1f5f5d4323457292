"""Qwen3.5/3.6-MoE text model: the forward over a flat batch of tokens, and the MTP head.

`model(input_ids, positions, meta, caches)` returns final-normed hidden states [T, H];
`model.compute_logits(hidden)` applies lm_head. Sequences share the step: linear layers see all
T tokens at once, the token mixers split them by `meta`.
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer.config import FULL, ModelConfig
from metainfer.forward_meta import CacheTensors, ForwardMeta
from metainfer.kernels import ops
from metainfer.model.attention import GatedAttention
from metainfer.model.deltanet import GatedDeltaNet
from metainfer.model.layers import ExpertRows, Linear, PendingNorm, RMSNorm, SparseMoE, fp8_copy_buffers


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, cache_index: int) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.cache_index = cache_index  # index into the caches of this layer's kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer_type == FULL:
            self.self_attn = GatedAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.mlp = SparseMoE(cfg)

    def forward(
        self,
        x: torch.Tensor | ExpertRows,  # [T, H] this layer's input (previous layer's MLP output)
        residual: torch.Tensor | None,  # [T, H] residual stream before adding x
        positions: torch.Tensor,
        meta: ForwardMeta,
        caches: CacheTensors,
    ) -> tuple[torch.Tensor | ExpertRows, torch.Tensor]:
        T, H, dev = positions.shape[0], self.input_layernorm.weight.shape[0], positions.device
        mixer = self.self_attn if self.layer_type == FULL else self.linear_attn
        if isinstance(x, ExpertRows) and residual is not None and ops.pending_norm_ok(x.rows, T):
            norm = self.input_layernorm  # its norm left to the mixer's first projection (its x prologue)
            h = PendingNorm(x, residual, norm.weight, norm.eps, torch.empty_like(residual))
            residual, xq = h.new_res, None
        else:
            consumer = mixer.input_proj(meta) if residual is not None else False  # layer 0: no add, no copy
            xq = fp8_copy_buffers(consumer, T, H, dev)
            h, residual = self.input_layernorm.add_forward(x, residual, xq_out=xq)
        i = self.cache_index
        if self.layer_type == FULL:
            h = self.self_attn(h, positions, meta, caches.k[i], caches.v[i], xq=xq)
        else:
            h = self.linear_attn(h, meta, caches.conv[i], caches.ssm[i], xq=xq)
        xq = fp8_copy_buffers(self.mlp.takes_fp8_input(T), T, H, dev)
        post = self.post_attention_layernorm
        routed = None if xq is not None else self.mlp.norm_and_route(post, h, residual)
        if routed is not None:  # the norm and the router in one launch (a decode step's few tokens)
            h, residual, logits = routed
            return self.mlp(h, logits=logits), residual
        h, residual = post.add_forward(h, residual, xq_out=xq)
        return self.mlp(h, xq), residual


class Qwen3_5MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        counters = {"full": 0, "linear": 0}
        layers = []
        for t in cfg.layer_types:
            kind = "full" if t == FULL else "linear"
            layers.append(DecoderLayer(cfg, t, counters[kind]))
            counters[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.layer_hook = None  # called after each layer when set; the residual stream is output + residual
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, {"lm_head": cfg.vocab_size})
        self.mtp = MTP(cfg, cache_index=counters["full"]) if cfg.mtp_num_hidden_layers > 0 else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: ForwardMeta,
        caches: CacheTensors,
    ) -> torch.Tensor:  # [T, H] final-normed hidden states
        # a step with a long prefill chunk launches (and a graph of one is captured) without
        # programmatic dependent launch (`ops.launch_context`)
        with ops.launch_context(meta.prefill_max_len()):
            x = self.embed_tokens(input_ids)
            residual = None
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, positions, meta, caches)
                if self.layer_hook is not None:  # oracle seam (eager steps): (layer, its output, residual)
                    self.layer_hook(i, x, residual)
            h, _ = self.norm.add_forward(x, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        return self.lm_logits(hidden).float()

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V], the model's dtype
        if self.cfg.tie_word_embeddings:
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)


class MTP(nn.Module):
    """Multi-token prediction head: from the main model's final hidden state at position t and the
    embedding of token t+1, predicts token t+2 with one full-attention MoE decoder layer."""

    def __init__(self, cfg: ModelConfig, cache_index: int) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = Linear(2 * H, {"fc": H})
        self.layers = nn.ModuleList([DecoderLayer(cfg, FULL, cache_index)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H] embeddings of the next tokens
        hidden: torch.Tensor,  # [T, H] main model's final hidden states
        positions: torch.Tensor,
        meta: ForwardMeta,
        caches: CacheTensors,
    ) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[0](x, None, positions, meta, caches)
        h, _ = self.norm.add_forward(x, residual)
        return h
