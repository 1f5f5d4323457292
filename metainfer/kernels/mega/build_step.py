"""The batch-1 decode step of an engine model (`Qwen3_5MoeModel`, FP8 experts) as a megakernel program:
per layer the token mixer's instructions, then the router, GateUp and Down; then the final norm and
the lm_head into a plain fp32 logits vector. The program reads the model's weights and the caches
in place (pointers), so it is built once per engine and replays every step; what changes per step
sits in `step` (program.STEP_*) and the block table.

Per DeltaNet layer: in_proj (input RMSNorm, the conv epilogue) -> DeltaState -> out_proj (the gated
norm of the core output with z, in_proj's rows past the conv channels). Per attention layer: qkv
(input RMSNorm) -> Attend (q/k norm, RoPE, cache write, split-KV partials) -> Combine (with the
sigmoid gate) -> o_proj. Then the router (add + RMSNorm of the residual stream h and the mixer's
output; bf16 logits), GateUp (the same normed input), Down (the weighted sum plus h + mixer output:
the next layer's h). The first layer's h is the token's embedding row.
"""

from __future__ import annotations

import torch

from metainfer.config import FULL
from metainfer.kernels.mega import program as P
from metainfer.model.meta import CacheTensors


def decode_program(model, caches: CacheTensors, block_table: torch.Tensor, logits: torch.Tensor,
                   splits: int = 8) -> list[P.Instr]:
    """The step's instructions (P.check them with P.Program). block_table [max_blocks] int32 (the
    sequence's), logits [V] fp32 (written untagged)."""
    instrs: list[P.Instr] = []

    def add(g: P.Instr) -> P.Src:
        instrs.append(g)
        return P.Src(len(instrs) - 1)

    h: P.X = P.Embed(model.embed_tokens.weight)
    for layer in model.layers:
        ci = layer.cache_index
        norm_in = layer.input_layernorm
        if layer.layer_type == FULL:
            a = layer.self_attn
            qkv = add(P.Gemv(a.qkv_proj.weight, h, ws=a.qkv_proj.weight_scale_inv, norm_w=norm_in.weight,
                             eps=norm_in.eps))
            parts = add(P.Attend(qkv, caches.k[ci], caches.v[ci], a.q_norm.weight, a.k_norm.weight,
                                 a.rotary.inv_freq, block_table, a.hq, splits, eps=a.q_norm.eps))
            o = add(P.Combine(parts, qkv, a.hq, a.d, splits))
            mix = add(P.Gemv(a.o_proj.weight, o, ws=a.o_proj.weight_scale_inv))
        else:
            d = layer.linear_attn
            C = d.conv_weight.shape[0]
            proj = add(P.Gemv(d.in_proj.weight, h, ws=d.in_proj.weight_scale_inv, norm_w=norm_in.weight,
                              eps=norm_in.eps, conv_state=caches.conv[ci], conv_w=d.conv_weight))
            core = add(P.DeltaState(proj, caches.ssm[ci], d.A_log, d.dt_bias, d.hk, b_off=C + d.value_dim,
                                    a_off=C + d.value_dim + d.hv))
            mix = add(P.Gemv(d.out_proj.weight, core, ws=d.out_proj.weight_scale_inv, norm_w=d.norm_weight,
                             add=P.Src(proj.index, C), gated=True, head_dim=d.dv, eps=d.eps))
        m, post = layer.mlp, layer.post_attention_layernorm
        if not m.fused_shared or m.w_gate_up_scale is None or m.router.weight_scale_inv is not None:
            raise ValueError("the megakernel takes FP8 experts, the shared expert fused, a bf16 router")
        router = add(P.Gemv(m.router.weight, h, norm_w=post.weight, add=mix, eps=post.eps))
        act = add(P.GateUp(m.w_gate_up, m.w_gate_up_scale, h, mix, post.weight, router, m.top_k,
                           eps=post.eps))
        h = add(P.Down(m.w_down, m.w_down_scale, act, router, h, mix, m.top_k))
    head = model.lm_head
    add(P.Gemv(head.weight, h, ws=head.weight_scale_inv, norm_w=model.norm.weight, eps=model.norm.eps,
               out=P.OUT_PLAIN_F32, plain_out=logits))
    return instrs


def step_inputs(step: torch.Tensor, token: int, position: int, kv_slot: int, state_slot: int,
                has_state: bool, seq_len: int) -> torch.Tensor:
    """Fills step [STEP_WORDS] int64 for one decode token (host values; the eager path)."""
    vals = [0] * P.STEP_WORDS
    vals[P.STEP_TOKEN], vals[P.STEP_POS], vals[P.STEP_KV_SLOT] = token, position, kv_slot
    vals[P.STEP_STATE_SLOT], vals[P.STEP_HAS_STATE] = state_slot, int(has_state)
    vals[P.STEP_SEQ_LEN] = seq_len
    step.copy_(torch.tensor(vals, dtype=torch.int64))
    return step
