// Part of gemv.cu (one translation unit: gemv.cu includes its parts in order): its layout constants and its
// launches' operands (the structs gemv.py mirrors in ctypes).
#pragma once

namespace {
constexpr int CHUNK = 32768, SEG = 512, NS = GEMV_SLOTS;
constexpr int MOE_MAX_E = 256, MOE_MAX_K = 16;  // routing: 8 logits a lane; the picks in shared memory
static_assert(NS == 4 || NS == 6, "4 or 6 ring slots");  // even: the two warpgroups take alternate chunks, so a
// slot's successive chunks are one warpgroup's, which waits their phases in order (with an odd ring the other
// warpgroup could wait a phase ahead: try_wait.parity passes on the phase before the current); 2 slots race
constexpr int KK = 2048, ROWS = CHUNK / KK, NB = KK / 128;  // K, rows a chunk, blocks a row
// shared memory: 1024 (alignment) + the ring and each slot's scales + B's terms (4 KB) + x's block powers of two,
// x (fp32) and the prologue's block sum + the ring's mbarriers + MOE's picks
constexpr size_t SMEM = 1024 + (size_t)NS * (CHUNK + NB * 4) + KK * 2 + (NB + KK + gemv::NCW) * sizeof(float) +
                        2 * NS * sizeof(uint64_t) + MOE_MAX_K * sizeof(int);
static_assert(SMEM <= 227 * 1024, "one CTA per SM");
constexpr int CONV_K = 4;  // the DeltaNet conv's kernel size (the launcher checks it)

struct Conv {  // the conv epilogue's operands (n_conv == 0: none)
  const __nv_bfloat16* w;  // [n_conv, CONV_K]
  __nv_bfloat16* state;    // [S, CONV_K - 1, n_conv] (strides s_slot, s_k, 1)
  const long long* slots;  // [1]
  const uint8_t* has;      // [1]
  long long s_slot, s_k;
  int n_conv;
};

// The x prologue of gemv_e4m3_pre: x = the previous MoE's rows summed into
// the residual, then this layer's input RMSNorm, as norm.moe_add_rms_norm computes it (sum_j tw[j] rows[j] in fp32
// and slot order, rounded to bf16; + res, rounded; rms over K; * (1 + w), rounded), each CTA for itself; CTA 0
// writes the new residual.
constexpr int PRE_MAX_W = 16;
struct Pre {
  const float* rows;         // [W, K] fp32: the MoE's unweighted rows of the token
  const float* tw;           // [W] their routing weights
  const __nv_bfloat16* res;  // [K] the residual stream before the add
  const __nv_bfloat16* w;    // [K] the input norm's weight
  __nv_bfloat16* new_res;    // [K] res + the sum (written by CTA 0)
  float eps;
  int W;  // <= PRE_MAX_W
};

struct Moe {  // moe_gate_up_e4m3's operands
  const __nv_bfloat16* logits;  // [E + 1] the router's logits, the shared expert's gate at E
  float* gu;                    // [top_k + 1][rows] fp32: each pair's gate rows then up rows, the shared pair last
  float* tw;                    // [top_k + 1] the renormalised top-k weights, then sigmoid(gate)
  long long* ids;               // [top_k + 1] the picks, then E
  int E, top_k, rows;           // E <= MOE_MAX_E, top_k < MOE_MAX_K, rows (2 I) a multiple of 128
};

}  // namespace
