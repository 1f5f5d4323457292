"""Gated full attention (the 10 `full_attention` layers and the MTP layer).

q_proj emits [query | gate] per head; q/k RMSNorm over head_dim; partial NeoX RoPE; GQA over the
paged KV cache; output x sigmoid(gate); o_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer.config import ModelConfig
from metainfer.forward_meta import ForwardMeta
from metainfer.kernels import ops
from metainfer.model.layers import Linear, RMSNorm, Rotary


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.d**-0.5
        self.qkv_proj = Linear(
            H, {"q_proj": 2 * self.hq * self.d, "k_proj": self.hkv * self.d, "v_proj": self.hkv * self.d}
        )
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.o_proj = Linear(self.hq * self.d, {"o_proj": H})
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        meta: ForwardMeta,
        k_cache: torch.Tensor,  # [N, bs, Hkv, D]
        v_cache: torch.Tensor,
        xq: tuple[torch.Tensor, torch.Tensor] | None = None,  # x's e4m3 copy from its norm, for qkv_proj
    ) -> torch.Tensor:
        T = x.shape[0]
        qg, k, v = self.qkv_proj.split(self.qkv_proj(x, xq))
        qg = qg.view(T, self.hq, 2 * self.d)
        q, gate = qg[..., : self.d], qg[..., self.d :]
        kv = (k.view(T, self.hkv, self.d), v.view(T, self.hkv, self.d))
        q = ops.qk_norm_rope_write(  # [T, Hq, D]; keys and values land in the cache
            q,
            *kv,
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,
            positions,
            self.rotary.inv_freq,
            k_cache,
            v_cache,
            meta.slot_mapping,
        )
        o = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, gate=gate)  # [T, Hq, D], gated
        return self.o_proj(o.reshape(T, self.hq * self.d))
