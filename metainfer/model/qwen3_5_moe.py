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
from metainfer.model.layers import ExpertRows, Linear, PendingNorm, RMSNorm, SparseMoE

E4M3 = torch.float8_e4m3fn


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
        # the modules whose weights' dtypes `plan_key` reads (a tuple: no second registration)
        first = self.self_attn.qkv_proj if layer_type == FULL else self.linear_attn.in_proj
        last = None if layer_type == FULL else self.linear_attn.out_proj
        self._planned = (self.mlp, self.mlp.router, first, last)

    def plan_key(self) -> tuple:
        """What `plan_weights` depends on beyond the config: the kind and the weights' dtypes (read from the
        modules' parameter dicts: every step reads them, per layer)."""
        mlp, router, first, last = self._planned
        out = last._parameters["weight"].dtype if last is not None else None
        return (self.layer_type, mlp._parameters["w_gate_up"].dtype, router._parameters["weight"].dtype,
                first._parameters["weight"].dtype, out)

    def plan_weights(self) -> ops.LayerWeights:
        """What `ops.step_plan` reads of this layer's weights."""
        mlp = self.mlp
        moe = (mlp.w_gate_up.dtype == E4M3, mlp.fused_shared, mlp.router.weight.dtype)
        if self.layer_type == FULL:
            return ops.LayerWeights(*moe, self.self_attn.qkv_proj.weight.dtype == E4M3)
        d = self.linear_attn
        return ops.LayerWeights(*moe, d.in_proj.weight.dtype == E4M3, True, d.hv, d.dv,
                                d.out_proj.out_features, d.out_proj.weight.dtype)

    def forward(
        self,
        x: torch.Tensor | ExpertRows,  # [T, H] this layer's input (previous layer's MLP output)
        residual: torch.Tensor | None,  # [T, H] residual stream before adding x
        positions: torch.Tensor,
        meta: ForwardMeta,
        caches: CacheTensors,
        plan: ops.StepPlan,  # `ops.step_plan` of this step and `plan_weights()`
    ) -> tuple[torch.Tensor | ExpertRows, torch.Tensor]:
        T, H, dev = positions.shape[0], self.input_layernorm.weight.shape[0], positions.device
        if plan.input_norm == "prologue" and isinstance(x, ExpertRows):
            norm = self.input_layernorm  # left to the mixer's first projection (its x prologue)
            h = PendingNorm(x, residual, norm.weight, norm.eps, torch.empty_like(residual))
            residual, xq = h.new_res, None
        else:  # layer 0 (no residual): no add, no copy
            xq = ops.act_buffers(T, H, dev) if plan.input_norm == "copy" and residual is not None else None
            h, residual = self.input_layernorm.add_forward(x, residual, xq_out=xq)
        i = self.cache_index
        if self.layer_type == FULL:
            h = self.self_attn(h, positions, meta, caches.k[i], caches.v[i], xq=xq)
        else:
            h = self.linear_attn(h, meta, caches.conv[i], caches.ssm[i], plan.out_norm, xq=xq)
        post = self.post_attention_layernorm
        if plan.moe_norm == "router":
            router = self.mlp.router.weight
            h, residual, logits = ops.add_rms_norm_router(h, residual, post.weight, post.eps, router)
            return self.mlp(h, plan.moe, logits=logits), residual
        xq = ops.act_buffers(T, H, dev) if plan.moe_norm == "copy" else None
        h, residual = post.add_forward(h, residual, xq_out=xq)
        return self.mlp(h, plan.moe, xq), residual


class StepPlans:
    """A forward's plans, one per distinct `plan_key()` among its layers (a layer kind, normally): each
    asked of `ops.step_plan` once."""

    def __init__(self, T: int, meta: ForwardMeta, x: torch.Tensor) -> None:
        self.args = (T, meta.num_decodes > 0)
        self.dtype, self.device = x.dtype, x.device
        self.plans: dict[tuple, ops.StepPlan] = {}

    def __call__(self, layer: DecoderLayer) -> ops.StepPlan:
        key = layer.plan_key()
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = ops.step_plan(*self.args, layer.plan_weights(), self.dtype, self.device)
        return plan


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
            plans = StepPlans(input_ids.shape[0], meta, x)
            residual = None
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, positions, meta, caches, plans(layer))
                if self.layer_hook is not None:  # oracle seam (eager steps): (layer, its output, residual)
                    self.layer_hook(i, x.value() if isinstance(x, ExpertRows) else x, residual)
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
        layer = self.layers[0]
        x, residual = layer(x, None, positions, meta, caches, StepPlans(x.shape[0], meta, x)(layer))
        h, _ = self.norm.add_forward(x, residual)
        return h
