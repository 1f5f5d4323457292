// Part of gemv.cu (one translation unit: gemv.cu includes its parts in order): its layout constants and its
// launches' operands (the structs gemv.py mirrors in ctypes).
#pragma once

namespace {
constexpr int CHUNK = 32768, SEG = 512, NS = GEMV_SLOTS;
constexpr int MOE_MAX_E = 256, MOE_MAX_K = 16;  // routing: 8 logits a lane; the picks in shared memory
static_assert(NS >= 2 && NS <= 6 && NS % 2 == 0, "2, 4 or 6 ring slots");  // even: the two warpgroups take
// alternate chunks, so a slot's successive chunks are one warpgroup's, which waits their phases in order (with an
// odd ring the other warpgroup could wait a phase ahead: try_wait.parity passes on the phase before the current)
constexpr int KK = 2048, ROWS = CHUNK / KK, NB = KK / 128;  // K, rows a chunk, blocks a row
// shared memory: 1024 (alignment) + the ring and each slot's scales + B's terms (4 KB) + x's block powers of two,
// x (fp32) and the prologue's block sum + the mbarriers (the ring's, and ROUTER's producer-ready) + MOE's picks
constexpr size_t SMEM = 1024 + (size_t)NS * (CHUNK + NB * 4) + KK * 2 + (NB + KK + mega::NCW) * sizeof(float) +
                        (2 * NS + 1) * sizeof(uint64_t) + MOE_MAX_K * sizeof(int);
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

// The x prologue of gemv_e4m3_pre (KB-0097): x = the previous MoE's rows summed into
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

constexpr int GDN_D = 128;                    // the DeltaNet's key and value head dims
constexpr unsigned GDN_ROWS = 3 * GDN_D + 2;  // y rows a value head's step reads: q, k (its key head's), v, b, a
struct Gdn {                                  // gemv_e4m3_pre_gdn's decode step (hv == 0: none)
  float* state;                               // [n_slots, hv, GDN_D, GDN_D] fp32, the slot's updated in place
  const long long* slots;                     // [1] the token's state slot
  const uint8_t* has;                         // [1] 0: the step starts from a zero state
  const void* a_log;                          // [hv] fp32 or bf16 (gate_f32)
  const void* dt_bias;                        // [hv]
  __nv_bfloat16* out;                         // [hv, GDN_D] the step's output
  unsigned* count;                            // [hv] rows of each head stored (0 between launches: CTA h resets)
  long long n_slots;
  int hv, hk, b_off, a_off;  // value and key heads (hv <= 32); y's b and a rows (q at 0, k at hk D, v at 2 hk D)
  int gate_f32, rot, waves;  // a_log / dt_bias fp32; the chunk order (see the header)
};

constexpr int DOWN_ROWS = 64;  // W rows a down chunk (K = SEG = 512)
struct Down {                  // moe_gate_up_down_e4m3's down projection (see the header)
  const float* ws;             // [E + 1, H / 128, SEG / 128] the down weights' block scales
  float* out;                  // [top_k + 1, H] fp32: each pair's unweighted rows, slot order (the shared pair last)
  unsigned* count;             // [MOE_MAX_K + 1]: virtual pair q's gate/up chunks stored (q = 0: shared), then
                               // the CTAs done (zero between launches: the last CTA resets them)
  int dpp;                     // down chunks a pair: H / DOWN_ROWS
};

// The post-mixer residual add, RMSNorm and router inside the experts' launch (METAINFER_WGMMA_GEMV_MOE_ROUTER,
// KB-0111): every CTA forms x = rms_norm(bf16(mixer + residual)) * (1 + w) for itself (as
// norm._add_rms_norm_router_kernel; CTA 0 writes the new residual), warp w of CTA b computes router row
// b + w grid (its weights loaded before the PDL wait) and stores the logit, counting it; the producer routes once
// all E + 1 are in (after its own PDL wait, which also orders its reads after the previous launch's reset of the
// count). The last CTA to finish zeroes the counts, once every CTA's producer has read them (the rdy mbarrier).
struct Router {
  const __nv_bfloat16* x;    // [K] the mixer's output
  const __nv_bfloat16* res;  // [K] the residual stream before the add
  const __nv_bfloat16* w;    // [K] the post-mixer norm's weight
  const __nv_bfloat16* rw;   // [E + 1, K] the router's weight (the shared expert's gate last), bf16
  __nv_bfloat16* new_res;    // [K] res + x (CTA 0)
  unsigned* count;           // [2]: logits stored, CTAs done (zero between launches: the last CTA resets them)
  float eps;
};

// The next projection's first chunks into L2 (METAINFER_WGMMA_GEMV_NEXT_L2, KB-0110): the experts' launch, once
// its producer has issued its last landing, prefetches the chunks the next layer's qkv / in_proj CTA of the same
// index lands first (chunk (b + k grid + rot) % n for k < k_max), so that the next launch's ring fills from L2
// where its CTAs cannot sit beside this launch's (both hold 144 KB of shared memory: moe_gate_up_down_e4m3).
struct Next {
  const uint8_t* w;  // the next projection's e4m3 weights [N, 2048] (null: none)
  int n, grid, rot;  // its chunks, grid and chunk rotation (gemv_e4m3_pre_gdn's rot, else 0)
  int k;             // chunks a CTA to prefetch
};
}  // namespace
