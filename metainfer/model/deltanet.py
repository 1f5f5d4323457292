"""Gated DeltaNet token mixer (the 30 `linear_attention` layers).

x -> in_proj -> [qkv | z | b | a]; qkv -> causal conv1d (state) -> SiLU -> q, k, v;
g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); gated delta rule (fp32 state);
gated RMSNorm with z; out_proj. Decodes run batched over state slots, prefills per sequence in
the chunked form. On the GPU kernels the decode conv is the in_proj kernel's epilogue
(`Linear.conv_forward`).
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer.config import ModelConfig
from metainfer.forward_meta import ForwardMeta
from metainfer.kernels import ops
from metainfer.model.layers import Linear


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.hk, self.dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.hv, self.dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.eps = cfg.rms_norm_eps
        self.in_proj = Linear(
            H,
            {
                "in_proj_qkv": cfg.linear_conv_dim,
                "in_proj_z": self.value_dim,
                "in_proj_b": self.hv,
                "in_proj_a": self.hv,
            },
        )
        self.conv_weight = nn.Parameter(
            torch.empty(cfg.linear_conv_dim, cfg.linear_conv_kernel_dim), requires_grad=False
        )
        self.A_log = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(self.dv), requires_grad=False)
        self.out_proj = Linear(self.value_dim, {"out_proj": H})

    def forward(
        self, x: torch.Tensor, meta: ForwardMeta, conv_state: torch.Tensor, ssm_state: torch.Tensor,
        out_norm: str = "norm",  # the step plan's: the gated norm before out_proj
        xq: tuple[torch.Tensor, torch.Tensor] | None = None,  # x's e4m3 copy from its norm, for in_proj
    ) -> torch.Tensor:  # [T, H] -> [T, H]
        T = x.shape[0]
        nd = meta.num_decodes
        slots, has_state = meta.state_slots[:nd], meta.has_state[:nd]
        if nd:  # the decode rows' qkv columns come back convolved (conv states updated)
            proj = self.in_proj.conv_forward(x, self.conv_weight, conv_state, slots, has_state)
        else:
            proj = self.in_proj(x, xq)
        mixed, z, b, a = self.in_proj.split(proj)
        core = (
            None if nd == T else torch.empty(T, self.hv, self.dv, dtype=x.dtype, device=x.device)
        )  # [T, Hv, Dv]
        if nd:
            q, k, v = torch.split(mixed[:nd], [self.key_dim, self.key_dim, self.value_dim], dim=-1)
            out = ops.gdn_decode_gated(
                q.view(nd, self.hk, self.dk),
                k.view(nd, self.hk, self.dk),
                v.view(nd, self.hv, self.dv),
                a[:nd],
                b[:nd],
                self.A_log,
                self.dt_bias,
                ssm_state,
                slots,
                has_state,
            )
            if core is None:  # a pure decode step: no copy
                core = out
            else:
                core[:nd] = out
        if meta.num_seqs > nd:  # the prefilling sequences, all at once
            qsl = meta.query_start_loc_cpu
            s0 = qsl[nd]
            rel = [x - s0 for x in qsl[nd:]]
            has = [c > 0 for c in meta.context_lens_cpu[nd:]]
            cu = meta.prefill_offsets()  # device offsets and the grids' bound, for the kernels
            max_len = meta.prefill_max_len()
            y = ops.causal_conv1d(
                mixed[s0:], conv_state, self.conv_weight, rel, meta.state_slots_cpu[nd:], has,
                cu, meta.state_slots[nd:], meta.has_state[nd:], max_len,
            )
            q, k, v = torch.split(y, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
            ops.gdn_prefill_varlen(  # gated from the raw a, b (in the kernel where enabled)
                q.view(-1, self.hk, self.dk),
                k.view(-1, self.hk, self.dk),
                v.view(-1, self.hv, self.dv),
                a[s0:],
                b[s0:],
                cu,
                ssm_state,
                meta.state_slots[nd:],
                meta.has_state[nd:],
                max_len,
                core[s0:],
                gating=(self.A_log, self.dt_bias),
            )
        z = z.view(T, self.hv, self.dv)
        if out_norm == "prologue":  # a decode step's few tokens: the norm as out_proj's prologue, one launch
            return ops.gated_norm_linear(core, z, self.norm_weight, self.eps, self.out_proj.weight,
                                         self.out_proj.weight_scale_inv)
        # "copy": the gated norm's e4m3 copy for out_proj (a head's row is whole 128-column groups)
        hq = ops.act_buffers(T, self.value_dim, x.device) if out_norm == "copy" else None
        h = ops.gated_rms_norm(core, z, self.norm_weight, self.eps, xq_out=hq)
        return self.out_proj(h.view(T, self.value_dim), hq)
