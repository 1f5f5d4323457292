// One decode token's FP8 projection on the megakernel's wgmma consumers, as a kernel of its own (KB-0092, KB-0094):
//   y[n] = bf16( sum_b scale[n / 128][b] * (W[n, 128 b : 128 b + 128] . x[128 b : 128 b + 128]) ),
// W [N, K] e4m3 with K = 2048 (N a multiple of 16), scale [ceil(N / 128), K / 128] fp32, x [K] bf16, y [N] bf16.
//
// One CTA per SM (grid <= the chunks). A chunk is 32 KB of W: 16 rows, the [64, 512] view of W's rows as
// [N * 4, 512] (row r's 512-byte segment s at view row 4 r + s). Warp 8 lands the
// CTA's chunks (chunk c on CTA c % grid) by TMA (boxes of 64 rows, 128-byte swizzle: launch.encode_tensor_map(w,
// 512, 64)) into a ring of GEMV_SLOTS x 32 KB, each with its K / 128 block scales on the same mbarrier. It starts
// before griddepcontrol.wait: weights and scales are never written during a step, so they stream while the previous
// kernel runs (programmatic dependent launch; metainfer/kernels/pdl.py's contract). Warps 0-7 (two warpgroups,
// alternate chunks) wait for the previous kernel, release the next one, read x, split it into two e4m3 terms per
// 128-column block (exact for bf16 down to 2^-9 of the block's largest) and reduce each chunk on wgmma
// (mega::stage_x8 and mega::wg_dot16: m64n8k32, B = the 4 segments' hi and lo terms). (A K = 4,096 form, m64n16k32
// on 8-row chunks, for the attention o_proj and the DeltaNet out_proj with its gated norm, measured no faster and
// was removed: KB-0095, benchmarks/results/2026-12-04e/k4096_forms_removed.patch.)
// Each 128-column block's product (its own accumulator chain) times the weight and x block scales, summed in fp32.
//
// moe_gate_up_e4m3 (KB-0096): the same K = 2048 kernel over one token's experts' gate/up rows (routed pairs and the
// shared expert, W [E + 1, rows, 2048]): chunk c of the (top_k + 1) rows / 16 is virtual (the shared expert's first,
// then pair 0's, ...). The producer lands the shared expert's chunks before griddepcontrol.wait, then routes (the
// top_k largest router logits, lowest index on ties: routing.softmax_topk's picks), landing each routed chunk as soon
// as its pick is found; the consumers write each row's dot in fp32 (gate and up apart: the down kernel forms
// silu(gate) * up).
//
// gemv_e4m3_pre_gdn (METAINFER_WGMMA_GEMV_GDN): the DeltaNet in_proj (x prologue and conv epilogue as above) with
// the layer's decode step (gdn_decode._gdn_decode_kernel's gated delta rule) in the same launch, one kernel
// boundary fewer a DeltaNet layer. Value head h's step is CTA h's (h < hv <= 32 < grid): each chunk's warpgroup,
// once its rows are stored, adds to count[h] the rows of head h it holds (its key head's q and k, its v, b and a:
// GDN_ROWS in all); CTA h, after its own chunks, waits for the count, then updates its [128, 128] fp32 state
// (prefetched into L2 by its producer at the start, landed in the ring after the CTA's chunks) and writes o. The
// chunks are taken in an order that lands the heads' rows first: from the b/a rows' chunk on (rot), then the rest;
// past `waves` chunks a CTA, only CTAs >= hv take more, so that the updaters start early (gemv.py's gdn_schedule).
//
// moe_gate_up_down_e4m3 (METAINFER_WGMMA_GEMV_MOE_DOWN): moe_gate_up_e4m3 with the experts' down projection after it
// in the same launch, one kernel boundary fewer a layer. The down weights [E + 1, H, I] (I = 512) are chunks of 64
// rows x 512 (the same [64, 512] view and TMA boxes: view row = W row, one segment); each CTA takes a run of them
// (pair by pair, the shared pair first) after its gate/up chunks, so its producer lands them while the gate/up runs.
// Each gate/up chunk adds one to its pair's count; a CTA's consumers wait until the pair's gate/up chunks are all in,
// form silu(gate) * up (bf16, as `_routed_down_kernel`) as x's first 512 columns, and reduce the chunks on wgmma
// (B: x's terms in columns 0, 1): each pair's unweighted fp32 rows, as `moe._routed_down`'s. The last CTA to finish
// zeroes the counts.
#include <cuda.h>  // CUtensorMap

#include "mega_math.cuh"

#ifndef GEMV_PRE_EARLY
#define GEMV_PRE_EARLY 0  // 1: the prologue's residual, norm weight and routing weights before the PDL wait, its rows
                          // in one wave of loads (gemv.py's DEFINES_ENV): neutral on the H200, KB-0102
#endif
#ifndef GEMV_PRE_WAVE
#define GEMV_PRE_WAVE 9  // GEMV_PRE_EARLY's rows in one wave of loads: the model's 8 routed experts and the shared one
#endif
#ifndef GEMV_SLOTS
#define GEMV_SLOTS 4  // ring slots of 32 KB (fewer: room on the SM for the next kernel's CTAs; gemv.py's SLOTS_ENV)
#endif

// The watchdog: every wait on another CTA's count or on the ring is bounded (~2^22 polls, seconds); the first
// thread to give up writes what it waited for into gemv_watch and traps. gemv.py points gemv_watch at pinned host
// memory, which the host can still read once the trap has ended the context (gemv.watchdog_report).
__device__ unsigned* gemv_watch;  // [8]: code (1 a count, 2 a full slot, 3 an empty slot), CTA, thread, what it
                                  // saw (the count; the chunk), what it needed (n; the parity), kernel; or null
__device__ unsigned gemv_claim;   // the first to give up (device memory: no atomics on the host's)

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

// p[i] as fp32, loaded past L1 (the previous kernel's output)
__device__ __forceinline__ float bf16_at(const __nv_bfloat16* p, int i) {
  return __uint_as_float(static_cast<uint32_t>(__ldcg(reinterpret_cast<const unsigned short*>(p) + i)) << 16);
}

// an order-preserving key of a float (-0 as +0; 0 is below every float's key: a removed pick)
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t b = __float_as_uint(v + 0.f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Routing by the producer warp (lane l holds experts l + 32 i): the top_k experts by router logit, largest first,
// the lowest index among equal logits (the picks of routing.softmax_topk, which ranks the same logits the same way).
// The picks need no exp and no sum; each is found when the producer first needs it (route_next), so a CTA whose
// next chunk belongs to pair 0 or 1 lands it after one or two rounds; CTA 0 then writes the weights (route_weights).
struct Route {
  uint32_t key[MOE_MAX_E / 32];  // order_key of the logits; 0: not an expert, or picked
};
__device__ __forceinline__ void route_load(const Moe& m, Route& r, int lane) {
#pragma unroll
  for (int i = 0; i < MOE_MAX_E / 32; ++i) {
    const int e = lane + 32 * i;
    r.key[i] = e < m.E ? order_key(bf16_at(m.logits, e)) : 0u;
  }
}
// the next pick (the same on every lane), removed from r
__device__ __forceinline__ int route_next(Route& r, int lane) {
  uint32_t bk = 0u;
  int bi = 0;
#pragma unroll
  for (int i = 0; i < MOE_MAX_E / 32; ++i)  // the lane's largest (its lowest index among equal keys)
    if (r.key[i] > bk) bk = r.key[i], bi = i;
  const uint32_t kmax = __reduce_max_sync(0xffffffffu, bk);
  const int best = static_cast<int>(
      __reduce_min_sync(0xffffffffu, bk == kmax ? static_cast<uint32_t>(lane + 32 * bi) : ~0u));
#pragma unroll
  for (int i = 0; i < MOE_MAX_E / 32; ++i)
    if (lane + 32 * i == best) r.key[i] = 0u;
  return best;
}
// CTA 0, all picks known: tw (the picks' softmax probabilities over the E logits, renormalised; the shared expert's
// sigmoid(gate) last) and ids
__device__ void route_weights(const Moe& m, const int* pick, int lane) {
  float l[MOE_MAX_E / 32], mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < MOE_MAX_E / 32; ++i) {
    l[i] = lane + 32 * i < m.E ? bf16_at(m.logits, lane + 32 * i) : -INFINITY;
    mx = fmaxf(mx, l[i]);
  }
  mx = mega::warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < MOE_MAX_E / 32; ++i) sum += lane + 32 * i < m.E ? expf(l[i] - mx) : 0.f;
  sum = mega::warp_sum(sum);
  const float p = lane < m.top_k ? expf(bf16_at(m.logits, pick[lane]) - mx) / sum : 0.f;
  const float psum = mega::warp_sum(p);
  if (lane < m.top_k) m.tw[lane] = p / psum, m.ids[lane] = pick[lane];
  if (lane == m.top_k) m.tw[lane] = 1.f / (1.f + expf(-bf16_at(m.logits, m.E))), m.ids[lane] = m.E;
}

// Pre's x into xs (fp32 of the bf16 values, at mega::xpos): consumer thread t holds columns 8 t .. 8 t + 7
// What the prologue may read before griddepcontrol.wait (GEMV_PRE_EARLY): the residual (written by the post-
// attention / post-DeltaNet norm three launches back), the norm's weight and the routing weights (written by the
// gate/up kernel two launches back); only the rows come from the launch just before (the experts' down). Not so
// beside moe_gate_up_down_e4m3, whose CTA 0 writes the routing weights late in the launch just before: gemv.py
// refuses that pair.
struct PreEarly {
  uint4 res, w;
  float tw[GEMV_PRE_WAVE];  // the first rows' weights (pre_rows)
};
__device__ __forceinline__ PreEarly pre_early(const Pre& p) {
  const int c0 = threadIdx.x * 8;
  PreEarly e;
  e.res = __ldcg(reinterpret_cast<const uint4*>(p.res + c0));
  e.w = __ldg(reinterpret_cast<const uint4*>(p.w + c0));
#pragma unroll
  for (int j = 0; j < GEMV_PRE_WAVE; ++j) e.tw[j] = j < p.W ? __ldcg(p.tw + j) : 0.f;
  return e;
}

// the sum of the W rows' columns c0..c0 + 7 weighted by tw, in slot order. GEMV_PRE_EARLY: the first
// GEMV_PRE_WAVE rows' loads all issued before the first FMA (one round trip: the per-row loop below issues the
// model's 9 rows in two waves, 8 then 1). A wave of 9 takes the kernel from 94 to 114 registers; all 16 rows
// unrolled together took 168, room the next kernel's CTAs need beside it under PDL.
__device__ __forceinline__ void pre_rows(const Pre& p, const float* tw, float (&acc)[8]) {
  const int c0 = threadIdx.x * 8;
  int j0 = 0;
#if GEMV_PRE_EARLY
  float4 a[GEMV_PRE_WAVE], b[GEMV_PRE_WAVE];
#pragma unroll
  for (int j = 0; j < GEMV_PRE_WAVE; ++j)
    if (j < p.W) {
      a[j] = __ldcg(reinterpret_cast<const float4*>(p.rows + (size_t)j * KK + c0));
      b[j] = __ldcg(reinterpret_cast<const float4*>(p.rows + (size_t)j * KK + c0) + 1);
    }
#pragma unroll
  for (int j = 0; j < GEMV_PRE_WAVE; ++j)
    if (j < p.W) {
      const float v[8] = {a[j].x, a[j].y, a[j].z, a[j].w, b[j].x, b[j].y, b[j].z, b[j].w};
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = fmaf(tw[j], v[i], acc[i]);
    }
  j0 = GEMV_PRE_WAVE;
#pragma unroll 1  // rows past the wave (none in the model): one at a time, not hoisted into the wave
#else
#pragma unroll
#endif
  for (int j = j0; j < PRE_MAX_W; ++j) {
    if (j < p.W) {
      const float t = __ldcg(p.tw + j);
      const float4 a = __ldcg(reinterpret_cast<const float4*>(p.rows + (size_t)j * KK + c0));
      const float4 b = __ldcg(reinterpret_cast<const float4*>(p.rows + (size_t)j * KK + c0) + 1);
      const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = fmaf(t, v[i], acc[i]);
    }
  }
}

// x's columns c0 .. c0 + 7 (c0 = 8 t of consumer thread t) = rms_norm(bf16(bf16(acc) + res)) * (1 + w), into xs
// at xpos; CTA 0 writes bf16(bf16(acc) + res) to new_res (rv, wv: res's and w's 8 columns)
__device__ void norm_into_xs(const float (&acc)[8], uint4 rv, uint4 wv, __nv_bfloat16* new_res, float eps,
                             float* xs, float* red, int cw, int lane) {
  const int c0 = threadIdx.x * 8;
  const uint32_t rw[4] = {rv.x, rv.y, rv.z, rv.w}, ww[4] = {wv.x, wv.y, wv.z, wv.w};
  float r[8], ss = 0.f;
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float res = __uint_as_float(i & 1 ? rw[i / 2] & 0xffff0000u : rw[i / 2] << 16);
    const float sum = __bfloat162float(__float2bfloat16_rn(acc[i]));  // the combine's rounding
    const __nv_bfloat16 rb = __float2bfloat16_rn(sum + res);
    r[i] = __bfloat162float(rb);
    ss = fmaf(r[i], r[i], ss);
    const uint32_t bits = __bfloat16_as_ushort(rb);
    out[i / 2] = i & 1 ? out[i / 2] | (bits << 16) : bits;
  }
  if (blockIdx.x == 0) *reinterpret_cast<uint4*>(new_res + c0) = make_uint4(out[0], out[1], out[2], out[3]);
  const float rstd = rsqrtf(mega::block_sum(ss, red, cw, lane) / KK + eps);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float w = __uint_as_float(i & 1 ? ww[i / 2] & 0xffff0000u : ww[i / 2] << 16);
    xs[mega::xpos(c0 + i)] = __bfloat162float(__float2bfloat16_rn(r[i] * rstd * (1.f + w)));
  }
}

__device__ void stage_pre(const Pre& p, const PreEarly& early, float* xs, float* red, int cw, int lane) {
  float acc[8] = {};
  pre_rows(p, early.tw, acc);
#if GEMV_PRE_EARLY
  const uint4 rv = early.res, wv = early.w;
#else
  const int c0 = threadIdx.x * 8;
  const uint4 rv = __ldcg(reinterpret_cast<const uint4*>(p.res + c0));
  const uint4 wv = __ldg(reinterpret_cast<const uint4*>(p.w + c0));
#endif
  norm_into_xs(acc, rv, wv, p.new_res, p.eps, xs, red, cw, lane);
}

// ROUTER's x: the mixer's output (exact in fp32) into norm_into_xs
__device__ void stage_router(const Router& rt, float* xs, float* red, int cw, int lane) {
  const int c0 = threadIdx.x * 8;
  const uint4 xv = __ldcg(reinterpret_cast<const uint4*>(rt.x + c0));
  const uint32_t xw[4] = {xv.x, xv.y, xv.z, xv.w};
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = __uint_as_float(i & 1 ? xw[i / 2] & 0xffff0000u : xw[i / 2] << 16);
  norm_into_xs(acc, __ldcg(reinterpret_cast<const uint4*>(rt.res + c0)),
               __ldg(reinterpret_cast<const uint4*>(rt.w + c0)), rt.new_res, rt.eps, xs, red, cw, lane);
}
// ROUTER's row of warp w (rr = b + w grid < E + 1): its 2048 weights, lane l columns 8 (l + 32 j) .. + 7, loaded
// before the PDL wait (weights); then logit rr = bf16(sum of w * x) over x in xs, stored and counted
struct RouterRow {
  uint4 w[KK / 256];
};
__device__ __forceinline__ void router_row_load(const Router& rt, int rr, int lane, RouterRow& row) {
#pragma unroll
  for (int j = 0; j < KK / 256; ++j)
    row.w[j] = __ldg(reinterpret_cast<const uint4*>(rt.rw + (size_t)rr * KK) + lane + 32 * j);
}
__device__ __forceinline__ void router_row_dot(const Router& rt, const Moe& m, int rr, int lane, const RouterRow& row,
                                               const float* xs) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < KK / 256; ++j) {
    const int c0 = (lane + 32 * j) * 8;
    const float4 a = *reinterpret_cast<const float4*>(xs + mega::xpos(c0));
    const float4 b = *reinterpret_cast<const float4*>(xs + mega::xpos(c0 + 4));
    const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    const uint32_t ww[4] = {row.w[j].x, row.w[j].y, row.w[j].z, row.w[j].w};
#pragma unroll
    for (int i = 0; i < 8; ++i)
      acc = fmaf(__uint_as_float(i & 1 ? ww[i / 2] & 0xffff0000u : ww[i / 2] << 16), xv[i], acc);
  }
  acc = mega::warp_sum(acc);
  if (lane == 0) {
    const_cast<__nv_bfloat16*>(m.logits)[rr] = __float2bfloat16_rn(acc);
    __threadfence();
    atomicAdd(rt.count, 1u);
  }
}

// The conv epilogue's loads for row n (a row < n_conv), issued before the chunk's dots so that their latency
// hides behind them: the row's conv weights and its slot's state (zeros without one)
struct ConvRow {
  float w[CONV_K];
  __nv_bfloat16 prev[CONV_K - 1];
};
__device__ __forceinline__ ConvRow conv_loads(int n, const Conv& cv, long long slot, bool has) {
  ConvRow r;
  const __nv_bfloat16* wn = cv.w + n * CONV_K;
  const __nv_bfloat16* sb = cv.state + slot * cv.s_slot + n;
#pragma unroll
  for (int j = 0; j < CONV_K; ++j) r.w[j] = __bfloat162float(wn[j]);
#pragma unroll
  for (int j = 0; j < CONV_K - 1; ++j) r.prev[j] = has ? sb[j * cv.s_k] : __float2bfloat16_rn(0.f);
  return r;
}

// row n (< n_conv) from its bf16 projection yb: silu(bf16(yb w[3] + sum_j prev[j] w[j])), the state shifted
__device__ __forceinline__ __nv_bfloat16 conv_row(__nv_bfloat16 yb, int n, const ConvRow& r, const Conv& cv,
                                                  long long slot) {
  float c = __bfloat162float(yb) * r.w[CONV_K - 1];
#pragma unroll
  for (int j = 0; j < CONV_K - 1; ++j) c = fmaf(__bfloat162float(r.prev[j]), r.w[j], c);
  __nv_bfloat16* sb = cv.state + slot * cv.s_slot + n;
#pragma unroll
  for (int j = 1; j < CONV_K - 1; ++j) sb[(j - 1) * cv.s_k] = r.prev[j];
  sb[(CONV_K - 2) * cv.s_k] = yb;
  c = __bfloat162float(__float2bfloat16_rn(c));  // the conv weight's dtype
  return __float2bfloat16_rn(c / (1.f + __expf(-c)));
}

enum : unsigned { WATCH_COUNT = 1, WATCH_FULL = 2, WATCH_EMPTY = 3, WATCH_READY = 4 };
constexpr uint32_t WATCH_LIMIT = 1u << 22;
// Only the first to give up traps, once its report is out: the others (all the CTAs' waits run out within
// microseconds of each other) sleep until that trap ends the grid, so that theirs cannot cut the report short
__device__ __noinline__ void give_up(unsigned code, unsigned saw, unsigned need, unsigned kernel) {
  if (atomicCAS(&gemv_claim, 0u, 1u) == 0u) {
    if (unsigned* w = gemv_watch) {
      w[1] = blockIdx.x, w[2] = threadIdx.x, w[3] = saw, w[4] = need, w[5] = kernel;
      __threadfence_system();
      w[0] = code;
      __threadfence_system();
    }
    __trap();
  }
  for (;;) __nanosleep(1u << 20);
}
// a count in global memory reaching n (one thread): bounded, so that a count that never comes traps (and says so)
// instead of hanging the step; kernel: which launch (gemv.py's WATCH_KERNELS)
// (relaxed polls, then a fence: the acquire; an ld.acquire each poll would invalidate the SM's L1 each time)
__device__ __forceinline__ void wait_at_least(const unsigned* p, unsigned n, unsigned kernel) {
  uint32_t i = 0;
  for (unsigned v; (v = ld_relaxed_u32(p)) < n;)
    if (++i == WATCH_LIMIT) give_up(WATCH_COUNT, v, n, kernel);
    else __nanosleep(32);
  __threadfence();
}
// an mbarrier phase (`mbar_wait`, bounded): a ring slot's (chunk `it` of this CTA), or ROUTER's producer-ready
// (kernel 3); one try inline
__device__ __noinline__ void ring_wait_slow(uint64_t* bar, uint32_t parity, unsigned code, unsigned it,
                                            unsigned kernel) {
  for (uint32_t n = 0; !mega::bar_try(bar, parity);)
    if (++n == WATCH_LIMIT) give_up(code, it, parity, kernel);
}
__device__ __forceinline__ void ring_wait(uint64_t* bar, uint32_t parity, unsigned code, unsigned it,
                                          unsigned kernel = 0) {
  if (!mega::bar_try(bar, parity)) ring_wait_slow(bar, parity, code, it, kernel);
}

// One down chunk's 64 dots (DOWN_ROWS rows of K = 512: the view rows are W's rows; B's columns 0, 1 hold x's first
// 512 columns' terms) on the calling warpgroup -> on lanes with lane % 4 == 0 of warp w4: rows 16 w4 + lane / 4 (.x)
// and + 8 (.y); ws: the chunk's 4 block scales
__device__ __forceinline__ float2 wg_dot64(const uint8_t* chunk, const float* ws, const uint8_t* b8, const float* xf) {
  float acc[4][4];
  mega::wg_mma_chunk(chunk, b8, acc);
  float v0 = 0.f, v1 = 0.f;
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    const float f = ws[kb] * xf[kb];
    v0 = fmaf(acc[kb][0] + acc[kb][1], f, v0);
    v1 = fmaf(acc[kb][2] + acc[kb][3], f, v1);
  }
  return make_float2(v0, v1);
}

// ---- the fused launches' schedules: host-callable, so tests/kernels/gemv_schedule_check.cu runs these very
// functions on the CPU ----
__host__ __device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
// the virtual index of CTA b's k-th chunk (of n, over grid CTAs), or -1: chunk b + k grid; with hv > 0 (GDN) that
// for k < waves only, past them the chunks left go to the CTAs >= hv alone
__host__ __device__ __forceinline__ int chunk_of(int b, int k, int grid, int n, int hv, int waves) {
  int c = b + k * grid;
  if (hv > 0 && k >= waves) {
    if (b < hv) return -1;
    c = waves * grid + (b - hv) + (k - waves) * (grid - hv);
  }
  return c < n ? c : -1;
}
// the chunks b + k grid < n: CTA b's count without GDN's rule
__host__ __device__ __forceinline__ int chunks_of(int b, int grid, int n) { return (n - b + grid - 1) / grid; }
// of y's rows r0 .. r0 + ROWS - 1, those value head h's step reads: its key head's q and k, its v, b and a
__host__ __device__ __forceinline__ int gdn_rows(const Gdn& g, int r0, int h) {
  const int kh = h / (g.hv / g.hk);
  const int at[5] = {kh * GDN_D, (g.hk + kh) * GDN_D, (2 * g.hk + h) * GDN_D, g.b_off + h, g.a_off + h};
  const int len[5] = {GDN_D, GDN_D, GDN_D, 1, 1};
  int n = 0;
  for (int i = 0; i < 5; ++i) n += imax(0, imin(at[i] + len[i], r0 + ROWS) - imax(at[i], r0));
  return n;
}
// whether any head's step reads one of rows r0 .. r0 + ROWS - 1 (q, k, v below (2 hk + hv) D; b; a): the z rows'
// chunks are counted by no one, so their warpgroups skip the fence and barrier
__host__ __device__ __forceinline__ bool gdn_awaited(const Gdn& g, int r0) {
  const int r1 = r0 + ROWS;
  return r0 < (2 * g.hk + g.hv) * GDN_D || (r0 < g.b_off + g.hv && g.b_off < r1) ||
         (r0 < g.a_off + g.hv && g.a_off < r1);
}
// CTA b's run of down chunks [lo, hi) of n_dn (moe_gate_up_down_e4m3: after its chunks_of(b, grid, gate/up) ones)
__host__ __device__ __forceinline__ void down_run(int b, int grid, int n_dn, int& lo, int& hi) {
  lo = b * n_dn / grid;
  hi = (b + 1) * n_dn / grid;
}

// ---- the DeltaNet decode step after the in_proj (GDN) ----
template <bool GDN>
__device__ __forceinline__ int chunk_at(int k, int n_chunks, const Gdn& g) {  // this CTA's k-th chunk, or -1
  return chunk_of(blockIdx.x, k, gridDim.x, n_chunks, GDN ? g.hv : 0, g.waves);
}
// rows r0 .. r0 + ROWS - 1 of y are stored: lane h (< hv) adds those its head reads to count[h]
__device__ __forceinline__ void gdn_arrive(const Gdn& g, int r0, int lane) {
  if (lane >= g.hv) return;
  const int n = gdn_rows(g, r0, lane);
  if (n) {
    __threadfence();
    atomicAdd(g.count + lane, static_cast<unsigned>(n));
  }
}
// the producer of CTA h < hv: its head's state into L2 (last step's: no wait; the slot clamped, a hint only)
__device__ __forceinline__ void gdn_prefetch(const Gdn& g) {
  if (blockIdx.x >= g.hv || __ldcg(g.has) == 0) return;
  const long long slot = min(max(__ldcg(g.slots), 0ll), g.n_slots - 1);
  const char* S = reinterpret_cast<const char*>(g.state + ((size_t)slot * g.hv + blockIdx.x) * GDN_D * GDN_D);
  for (int i = 0; i < 4; ++i) l2_prefetch(S + i * 16384, 16384);
}
// Triton's fp32 exp and division as its PTX has them (tl.exp: ex2.approx.f32 of x log2 e, __expf's form; tl.sigmoid
// and `/`: div.full.f32), so that beta, rounded to bf16, takes the same bits as _gdn_decode_kernel's
__device__ __forceinline__ float tl_div(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float gdn_param(const void* p, int h, int f32) {
  return f32 ? static_cast<const float*>(p)[h] : __bfloat162float(static_cast<const __nv_bfloat16*>(p)[h]);
}
// CTA h's step, all consumer warps, after their chunks: `_gdn_decode_kernel`'s arithmetic (q, k l2-normalised, q
// scaled by D^-0.5; g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) rounded to bf16; S *= exp(g);
// delta = (v - S^T k) beta; S += k delta^T; o = S^T q). The state is in the ring: the producer lands its rows 0-63
// and 64-127 as the CTA's chunks k0 and k0 + 1 (sa, sb: their slots, on the mbarriers fa, fb; all of the CTA's
// chunks are done). Thread (cw, lane) takes columns 4 lane .. + 3 of rows 16 cw .. + 15; sc: scratch (xs, free once
// the chunks are done)
__device__ void gdn_update(const Gdn& g, const __nv_bfloat16* y, float* sc, const float* sa, const float* sb,
                           uint64_t* fa, uint64_t* fb, int k0, int cw, int lane) {
  const int h = blockIdx.x, kh = h / (g.hv / g.hk), r0 = cw * 16, c0 = lane * 4;
  float* qn = sc;              // [D]
  float* kn = qn + GDN_D;      // [D]
  float* gates = kn + GDN_D;   // decay, beta
  float* red = gates + 4;      // [NCW][D]
  const long long slot = g.slots[0];
  const bool has = g.has[0] != 0;
  float* S = g.state + ((size_t)slot * g.hv + h) * GDN_D * GDN_D;
  const float* rows = (r0 < 64 ? sa : sb) + (r0 % 64) * GDN_D + c0;  // this thread's 16 rows (in one piece)
  consumers_sync(mega::CT);  // both warpgroups are past their chunks: xs is free, and every earlier phase of the
  // state's slots is complete, so each thread's parity wait below is on the current phase (not one ahead)
  ring_wait(fa, (k0 / NS) & 1, WATCH_FULL, k0);
  ring_wait(fb, ((k0 + 1) / NS) & 1, WATCH_FULL, k0 + 1);
  if (threadIdx.x == 0) wait_at_least(g.count + h, GDN_ROWS, 1);
  consumers_sync(mega::CT);
  if (cw < 2) {  // warp 0: q, warp 1: k
    const __nv_bfloat16* src = y + (cw == 0 ? kh : g.hk + kh) * GDN_D;
    float v[4], ss = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = bf16_at(src, lane + 32 * j), ss += v[j] * v[j];
    const float r = rsqrtf(mega::warp_sum(ss) + 1e-6f);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      (cw == 0 ? qn : kn)[lane + 32 * j] = cw == 0 ? v[j] * r * 0.08838834764831845f : v[j] * r;
  } else if (cw == 2 && lane == 0) {
    const float a = bf16_at(y, g.a_off + h) + gdn_param(g.dt_bias, h, g.gate_f32);
    const float sp = a > 20.f ? a : logf(1.f + __expf(a));
    gates[0] = __expf(-__expf(gdn_param(g.a_log, h, g.gate_f32)) * sp);
    gates[1] = __bfloat162float(__float2bfloat16_rn(tl_div(1.f, 1.f + __expf(-bf16_at(y, g.b_off + h)))));
  }
  float v[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) v[c] = bf16_at(y, (2 * g.hk + h) * GDN_D + c0 + c);
  consumers_sync(mega::CT);
  const float decay = gates[0], beta = gates[1];
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  float4 kv = zero;
#pragma unroll
  for (int r = 0; r < 16; ++r) {  // S^T k of the decayed state (a zero state where the slot holds none)
    float4 st = has ? *reinterpret_cast<const float4*>(rows + r * GDN_D) : zero;
    const float k = kn[r0 + r];
    st.x *= decay, st.y *= decay, st.z *= decay, st.w *= decay;
    kv.x = fmaf(st.x, k, kv.x), kv.y = fmaf(st.y, k, kv.y), kv.z = fmaf(st.z, k, kv.z), kv.w = fmaf(st.w, k, kv.w);
  }
  *reinterpret_cast<float4*>(red + cw * GDN_D + c0) = kv;
  consumers_sync(mega::CT);
  kv = zero;
#pragma unroll
  for (int w = 0; w < mega::NCW; ++w) {
    const float4 p = *reinterpret_cast<const float4*>(red + w * GDN_D + c0);
    kv.x += p.x, kv.y += p.y, kv.z += p.z, kv.w += p.w;
  }
  const float4 d = make_float4((v[0] - kv.x) * beta, (v[1] - kv.y) * beta, (v[2] - kv.z) * beta, (v[3] - kv.w) * beta);
  float4 o = zero;
#pragma unroll
  for (int r = 0; r < 16; ++r) {  // S = decay S + k delta^T, written back; o = S^T q
    float4 st = has ? *reinterpret_cast<const float4*>(rows + r * GDN_D) : zero;
    const float k = kn[r0 + r], q = qn[r0 + r];
    st.x *= decay, st.y *= decay, st.z *= decay, st.w *= decay;
    st.x = fmaf(k, d.x, st.x), st.y = fmaf(k, d.y, st.y), st.z = fmaf(k, d.z, st.z), st.w = fmaf(k, d.w, st.w);
    o.x = fmaf(st.x, q, o.x), o.y = fmaf(st.y, q, o.y), o.z = fmaf(st.z, q, o.z), o.w = fmaf(st.w, q, o.w);
    __stcg(reinterpret_cast<float4*>(S + (r0 + r) * GDN_D + c0), st);
  }
  consumers_sync(mega::CT);  // every thread has read red's kv
  *reinterpret_cast<float4*>(red + cw * GDN_D + c0) = o;
  consumers_sync(mega::CT);
  if (cw == 0) {
    o = zero;
#pragma unroll
    for (int w = 0; w < mega::NCW; ++w) {
      const float4 p = *reinterpret_cast<const float4*>(red + w * GDN_D + c0);
      o.x += p.x, o.y += p.y, o.z += p.z, o.w += p.w;
    }
    const __nv_bfloat162 lo = __floats2bfloat162_rn(o.x, o.y), hi = __floats2bfloat162_rn(o.z, o.w);
    uint2 bits;
    bits.x = *reinterpret_cast<const uint32_t*>(&lo);
    bits.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(g.out + h * GDN_D + c0) = bits;
    if (lane == 0) g.count[h] = 0u;  // every arrival of this launch is counted: ready for the next
  }
}
}  // namespace

template <bool MOE, bool PRE = false, bool GDN = false, bool DOWN = false, bool ROUTER = false, bool W16 = false>
__device__ __forceinline__ void gemv_body(const CUtensorMap* wmap, const float* __restrict__ ws,
                                          const __nv_bfloat16* x, __nv_bfloat16* y, int n_rows, const Conv& conv,
                                          const Pre& pre, const Moe& moe, const Gdn& gdn = Gdn{},
                                          const CUtensorMap* dmap = nullptr, const Down& dn = Down{},
                                          const Next& nx = Next{}, const Router& rt = Router{}) {
  static_assert(!W16 || !(GDN || DOWN || ROUTER), "bf16 weights: the projections and the gate/up (KB-0114)");
  constexpr int RPC = W16 ? 8 : ROWS;  // W's rows a chunk: 8 of bf16, 16 of e4m3 (32 KB either way)
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* ring = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);  // swizzle atoms: 1024-aligned
  float* wsc = reinterpret_cast<float*>(ring + NS * CHUNK);  // [NS][NB] each chunk's block scales
  uint8_t* b8 = reinterpret_cast<uint8_t*>(wsc + NS * NB);   // x's two e4m3 terms (K * 2 bytes)
  float* xf = reinterpret_cast<float*>(b8 + KK * 2);         // [NB] 2^-e per block
  float* xs = xf + NB;                                       // [KK] x (fp32, permuted: mega::xpos)
  float* red = xs + KK;                                      // [NCW] the prologue's block sum
  uint64_t* full = reinterpret_cast<uint64_t*>(red + mega::NCW);
  uint64_t* empty = full + NS;
  uint64_t* rdy = empty + NS;                    // ROUTER: the producer is past its wait on the logits' count
  int* pick = reinterpret_cast<int*>(rdy + 1);  // MOE: the routed experts
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_chunks = n_rows / RPC, grid = gridDim.x;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NS; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 4);  // the chunk's warpgroup
    }
    mbar_init(rdy, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == mega::NCW) {  // producer: no wait (static bytes only), except for MOE's routing
    // chunk it of this CTA into its slot: the map's view rows v64 .. v64 + 63 and their block scales
    auto land_at = [&](uint32_t it, const CUtensorMap* map, int v64, const float* sc, uint32_t sbytes) {
      const uint32_t slot = it % NS;
      ring_wait(&empty[slot], ((it / NS) & 1) ^ 1, WATCH_EMPTY, it);
      mbar_expect_tx(&full[slot], CHUNK + sbytes);
      for (int kb = 0; kb < SEG / 128; ++kb) tma_2d(ring + slot * CHUNK + kb * 8192, map, kb * 128, v64, &full[slot]);
      if (sbytes) bulk_load(wsc + slot * NB, sc, sbytes, &full[slot]);
    };
    // W's chunk g (its rows g * ROWS..)
    auto land = [&](uint32_t it, int g) {  // (bf16: no block scales)
      if constexpr (W16) land_at(it, wmap, g * 64, nullptr, 0);
      else land_at(it, wmap, g * 64, ws + (size_t)(g * ROWS / 128) * NB, NB * 4);
    };
    int c = blockIdx.x;
    uint32_t it = 0;
    if constexpr (MOE) {
      const int cpp = moe.rows / RPC;  // chunks a pair; virtual chunk c: pair q - 1 of c / cpp (q = 0: shared)
      for (; c < cpp; c += grid, ++it)  // the shared expert's: static
        if (lane == 0) land(it, moe.E * cpp + c);
      asm volatile("griddepcontrol.wait;" ::: "memory");  // the router's logits (ROUTER: the count's last reset)
      if constexpr (ROUTER) {  // the logits are this launch's consumers': all E + 1 stored
        if (lane == 0) {
          wait_at_least(rt.count, moe.E + 1, 3);
          mbar_arrive(rdy);
        }
        __syncwarp();
      }
      Route r;
      route_load(moe, r, lane);
      int known = 0;  // picks found
      for (; c < n_chunks; c += grid, ++it) {
        const int q = c / cpp;
        for (; known < q; ++known) {  // (warp-uniform)
          const int e = route_next(r, lane);
          if (lane == 0) pick[known] = e;
        }
        if (lane == 0) land(it, pick[q - 1] * cpp + c - q * cpp);
      }
      if constexpr (DOWN) {  // this CTA's run of down chunks: down chunk d of virtual pair d / dpp
        int lo, hi;
        down_run(blockIdx.x, grid, (moe.top_k + 1) * dn.dpp, lo, hi);
        for (int d = lo; d < hi; ++d, ++it) {
          const int q = d / dn.dpp;
          for (; known < q; ++known) {
            const int e = route_next(r, lane);
            if (lane == 0) pick[known] = e;
          }
          const int gd = (q == 0 ? moe.E : pick[q - 1]) * dn.dpp + d % dn.dpp;  // in the [(E + 1) H, 512] view
          if (lane == 0) land_at(it, dmap, gd * DOWN_ROWS, dn.ws + (size_t)(gd * DOWN_ROWS / 128) * (SEG / 128), 16);
        }
      }
      if (lane == 0 && nx.w != nullptr && blockIdx.x < nx.grid)  // every landing issued: the next projection's
        for (int k = 0, c = blockIdx.x; k < nx.k && c < nx.n; ++k, c += nx.grid)  // first chunks into L2
          l2_prefetch(nx.w + (size_t)((c + nx.rot) % nx.n) * CHUNK, CHUNK);
      if (blockIdx.x == 0) {
        for (; known < moe.top_k; ++known) {
          const int e = route_next(r, lane);
          if (lane == 0) pick[known] = e;
        }
        __syncwarp();
        route_weights(moe, pick, lane);
      }
    } else if (lane == 0) {
      if (GDN) gdn_prefetch(gdn);
      int k = 0;
      for (; (c = chunk_at<GDN>(k, n_chunks, gdn)) >= 0; ++k) land(k, GDN ? (c + gdn.rot) % n_chunks : c);
      if (GDN && blockIdx.x < gdn.hv) {  // CTA h: its head's state, rows 0-63 and 64-127, as chunks k and k + 1
        asm volatile("griddepcontrol.wait;" ::: "memory");  // (the slot is a step input: final after the wait)
        const float* S = gdn.state + ((size_t)gdn.slots[0] * gdn.hv + blockIdx.x) * GDN_D * GDN_D;
        for (int j = 0; j < 2; ++j, ++k) {
          const uint32_t sl = k % NS;
          ring_wait(&empty[sl], ((k / NS) & 1) ^ 1, WATCH_EMPTY, k);
          mbar_expect_tx(&full[sl], CHUNK);
          bulk_load(ring + sl * CHUNK, S + j * (CHUNK / 4), CHUNK, &full[sl]);
        }
      }
    }
    return;
  }
  PreEarly early;
  if constexpr (PRE && GEMV_PRE_EARLY) early = pre_early(pre);  // none of it written by the previous kernel
  const int rr = blockIdx.x + warp * grid;  // ROUTER: this warp's router row (one at most: gemv.py checks)
  RouterRow rrow;
  if (ROUTER && rr <= moe.E) router_row_load(rt, rr, lane, rrow);  // weights: before the wait
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
  if (threadIdx.x == 0) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  static_assert(KK % (8 * mega::CT) == 0, "whole 16-byte loads of x per consumer thread");
  constexpr int NV = KK / (8 * mega::CT);
  if (PRE) {
    stage_pre(pre, early, xs, red, warp, lane);
  } else if (ROUTER) {
    stage_router(rt, xs, red, warp, lane);
  } else {
    uint4 xv[NV];  // x: 16-byte loads of 8 bf16, all in flight, then fp32 into xs at xpos
#pragma unroll
    for (int j = 0; j < NV; ++j) xv[j] = __ldcg(reinterpret_cast<const uint4*>(x) + threadIdx.x + j * mega::CT);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const uint32_t w[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int e = (threadIdx.x + j * mega::CT) * 8 + 2 * i;
        xs[mega::xpos(e)] = __uint_as_float(w[i] << 16);
        xs[mega::xpos(e + 1)] = __uint_as_float(w[i] & 0xffff0000u);
      }
    }
  }
  consumers_sync(mega::CT);
  if (ROUTER && rr <= moe.E) router_row_dot(rt, moe, rr, lane, rrow, xs);
  if constexpr (W16) mega::stage_xb16(xs, b8, threadIdx.x);
  else mega::stage_x8(xs, b8, xf, warp, lane);
  consumers_sync(mega::CT);
  const int wg = warp / 4, w4 = warp & 3;
  const long long slot = conv.n_conv ? conv.slots[0] : 0;  // (after the wait: the step's inputs)
  const bool has = conv.n_conv && conv.has[0] != 0;
  for (int it = wg, c; (c = chunk_at<GDN>(it, n_chunks, gdn)) >= 0; it += 2) {
    const uint32_t slot_i = it % NS;
    const int p = GDN ? (c + gdn.rot) % n_chunks : c;  // W's chunk (MOE: c, virtual)
    // e4m3: lanes 0-3 store the warp's 4 rows; bf16: lanes 0-1 its 2
    const int row = W16 ? p * 8 + 2 * w4 + (lane & 1) : p * 16 + 4 * w4 + (lane & 3);
    const bool is_conv = lane < (W16 ? 2 : 4) && row < conv.n_conv;
    ConvRow cr;
    if (is_conv) cr = conv_loads(row, conv, slot, has);
    ring_wait(&full[slot_i], (it / NS) & 1, WATCH_FULL, it);
    if constexpr (W16) {  // rows 2 w4 (.x) and 2 w4 + 1 (.y) on every lane
      const float2 v = mega::wg_dot8_bf16(ring + slot_i * CHUNK, b8, lane);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot_i]);
      if (MOE && lane < 2) {  // pair q - 1's row (q = 0: the shared pair, top_k)
        const int cpp = moe.rows / RPC, q = c / cpp;
        const int pair = q == 0 ? moe.top_k : q - 1;
        moe.gu[(size_t)pair * moe.rows + (c - q * cpp) * RPC + 2 * w4 + lane] = lane ? v.y : v.x;
      } else if (lane < 2) {
        const __nv_bfloat16 yb = __float2bfloat16_rn(lane ? v.y : v.x);
        y[row] = is_conv ? conv_row(yb, row, cr, conv, slot) : yb;
      }
      continue;
    }
    const float2 v = mega::wg_dot16(ring + slot_i * CHUNK, wsc + slot_i * NB, b8, xf, lane);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot_i]);
    // wg_dot16: rows 4 w4 + {0, 1} (.x on lanes 0, 16) and 4 w4 + {2, 3} (.y on lanes 0, 16)
    const float r01 = __shfl_sync(0xffffffffu, v.x, (lane & 1) * 16);
    const float r23 = __shfl_sync(0xffffffffu, v.y, (lane & 1) * 16);
    if (MOE && lane < 4) {  // pair q - 1's row (q = 0: the shared pair, top_k)
      const int cpp = moe.rows / ROWS, q = c / cpp;
      const int pair = q == 0 ? moe.top_k : q - 1;
      moe.gu[(size_t)pair * moe.rows + (c - q * cpp) * ROWS + 4 * w4 + lane] = lane < 2 ? r01 : r23;
    } else if (lane < 4) {
      const __nv_bfloat16 yb = __float2bfloat16_rn(lane < 2 ? r01 : r23);
      y[row] = is_conv ? conv_row(yb, row, cr, conv, slot) : yb;
    }
    if (DOWN || (GDN && gdn_awaited(gdn, p * ROWS))) {  // the chunk's 16 outputs are stored (lanes 0-3 of each
      // warp): count them where awaited (p is the warpgroup's: the barrier is taken by all of it or none)
      if (lane < 4) __threadfence();
      warpgroup_sync(wg);
      if (GDN && w4 == 0) gdn_arrive(gdn, p * ROWS, lane);  // for the heads that read these rows
      if (DOWN && w4 == 0 && lane == 0) {  // one more of its pair's: the fence after the barrier, so that it
        __threadfence();                     // orders the other warps' stores too (the PTX model's cumulativity)
        atomicAdd(dn.count + c / (moe.rows / ROWS), 1u);
      }
    }
  }
  if (GDN && blockIdx.x < gdn.hv) {  // the state's two pieces follow the CTA's chunks in the ring
    const int k0 = imin(gdn.waves, chunks_of(blockIdx.x, grid, n_chunks));
    gdn_update(gdn, y, xs, reinterpret_cast<const float*>(ring + (k0 % NS) * CHUNK),
               reinterpret_cast<const float*>(ring + ((k0 + 1) % NS) * CHUNK), &full[k0 % NS],
               &full[(k0 + 1) % NS], k0, warp, lane);
  }
  if constexpr (DOWN) {
    const int cpp = moe.rows / ROWS, I = moe.rows / 2, H = dn.dpp * DOWN_ROWS;
    int lo, hi;
    down_run(blockIdx.x, grid, (moe.top_k + 1) * dn.dpp, lo, hi);
    const int first = chunks_of(blockIdx.x, grid, n_chunks);  // this CTA's gate/up chunks: it 0 .. first - 1
    for (int d = lo; d < hi;) {  // one pair's part of the run at a time
      const int q = d / dn.dpp, end = min(hi, (q + 1) * dn.dpp), pair = q == 0 ? moe.top_k : q - 1;
      consumers_sync(mega::CT);  // the chunks before are done with x's terms
      if (threadIdx.x == 0) wait_at_least(dn.count + q, cpp, 2);
      consumers_sync(mega::CT);
      const float* gu = moe.gu + (size_t)pair * moe.rows;
      for (int i = threadIdx.x; i < I; i += mega::CT) {  // silu(gate) * up, rounded to bf16 (the kernel's x dtype)
        const float gv = __ldcg(gu + i), uv = __ldcg(gu + I + i);
        xs[mega::xpos(i)] = __bfloat162float(__float2bfloat16_rn(gv * (1.f / (1.f + expf(-gv))) * uv));
      }
      consumers_sync(mega::CT);
      mega::stage_x8(xs, b8, xf, warp, lane, I / 128);
      consumers_sync(mega::CT);
      for (int it = first + (d - lo); d < end; ++d, ++it) {
        if ((it & 1) != wg) continue;
        const uint32_t slot_i = it % NS;
        ring_wait(&full[slot_i], (it / NS) & 1, WATCH_FULL, it);
        const float2 v = wg_dot64(ring + slot_i * CHUNK, wsc + slot_i * NB, b8, xf);
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot_i]);
        if ((lane & 3) == 0) {
          float* o = dn.out + (size_t)pair * H + (d % dn.dpp) * DOWN_ROWS + 16 * w4 + (lane >> 2);
          o[0] = v.x;
          o[8] = v.y;
        }
      }
    }
    consumers_sync(mega::CT);  // every read of this CTA's counts is done
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(dn.count + MOE_MAX_K, 1u) == gridDim.x - 1) {  // the last CTA: no count is read any more
        __threadfence();  // (acquire: every CTA's increments are before the zeroes)
        for (int q = 0; q <= moe.top_k; ++q) dn.count[q] = 0u;
        dn.count[MOE_MAX_K] = 0u;
      }
    }
  }
  if constexpr (ROUTER) {  // the logits' count: zeroed by the last CTA once every CTA's producer is past its wait
    if (threadIdx.x == 0) {
      ring_wait(rdy, 0, WATCH_READY, 0, 3);
      __threadfence();
      if (atomicAdd(rt.count + 1, 1u) == gridDim.x - 1) {
        __threadfence();
        rt.count[0] = 0u;
        rt.count[1] = 0u;
      }
    }
  }
}

// K = 2048 (with the conv epilogue where conv.n_conv > 0)
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    gemv_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws, const __nv_bfloat16* x,
              __nv_bfloat16* y, int n_rows, const Conv conv) {
  gemv_body<false>(&wmap, ws, x, y, n_rows, conv, Pre{}, Moe{});
}

// the same with x from the prologue (Pre: the previous MoE's sum, the residual add and the input norm)
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    gemv_e4m3_pre(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws, __nv_bfloat16* y,
                  int n_rows, const Conv conv, const Pre pre) {
  gemv_body<false, true>(&wmap, ws, nullptr, y, n_rows, conv, pre, Moe{});
}

// gemv_e4m3_pre of bf16 weights (KB-0114; W [N, 2048] bf16, N a multiple of 8, no scales): the BF16 model's qkv /
// in_proj with the input norm as the x prologue and the decode conv as the epilogue
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    gemv_bf16_pre(const __grid_constant__ CUtensorMap wmap, __nv_bfloat16* y, int n_rows, const Conv conv,
                  const Pre pre) {
  gemv_body<false, true, false, false, false, true>(&wmap, nullptr, nullptr, y, n_rows, conv, pre, Moe{});
}

// gemv_e4m3_pre with the DeltaNet decode step after it (Gdn: see the header)
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    gemv_e4m3_pre_gdn(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws, __nv_bfloat16* y,
                      int n_rows, const Conv conv, const Pre pre, const Gdn gdn) {
  gemv_body<false, true, true>(&wmap, ws, nullptr, y, n_rows, conv, pre, Moe{}, gdn);
}

// one token's experts' gate/up (x: the normed hidden state), routed here from moe.logits (see the header)
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    moe_gate_up_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws,
                     const __nv_bfloat16* x, const Moe moe, const Next nx) {
  gemv_body<true>(&wmap, ws, x, nullptr, (moe.top_k + 1) * moe.rows, Conv{}, Pre{}, moe, Gdn{}, nullptr, Down{}, nx);
}

// moe_gate_up_e4m3 of bf16 weights (KB-0114; w [E + 1, rows, 2048] bf16, 8 rows a chunk, no scales): the BF16
// model's experts' gate/up, routed in the producer as the e4m3 form is
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    moe_gate_up_bf16(const __grid_constant__ CUtensorMap wmap, const __nv_bfloat16* x, const Moe moe,
                     const Next nx) {
  gemv_body<true, false, false, false, false, true>(&wmap, nullptr, x, nullptr, (moe.top_k + 1) * moe.rows, Conv{},
                                                    Pre{}, moe, Gdn{}, nullptr, Down{}, nx);
}

// moe_gate_up_e4m3 with the experts' down projection after it (Down: see the header)
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    moe_gate_up_down_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws,
                          const __nv_bfloat16* x, const Moe moe, const __grid_constant__ CUtensorMap dmap,
                          const Down dn, const Next nx) {
  gemv_body<true, false, false, true>(&wmap, ws, x, nullptr, (moe.top_k + 1) * moe.rows, Conv{}, Pre{}, moe, Gdn{},
                                      &dmap, dn, nx);
}

// moe_gate_up_down_e4m3 with the post-mixer add, RMSNorm and router in the same launch (Router: see its struct;
// moe.logits is where the logits go, x is the consumers' own). Only with the down: the Triton down after
// moe_gate_up_e4m3 reads the logits before its PDL wait, which this launch would write just before it.
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    moe_router_gate_up_down_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws,
                                 const Moe moe, const __grid_constant__ CUtensorMap dmap, const Down dn,
                                 const Next nx, const Router rt) {
  gemv_body<true, false, false, true, true>(&wmap, ws, nullptr, nullptr, (moe.top_k + 1) * moe.rows, Conv{}, Pre{},
                                            moe, Gdn{}, &dmap, dn, nx, rt);
}

// the watchdog's report buffer (gemv.py: pinned host memory, once at load)
extern "C" __global__ void gemv_set_watch(unsigned* w) { gemv_watch = w; }

// the layout constants the launcher (gemv.py) must agree with
extern "C" __global__ void gemv_constants(long long* out) {
  out[0] = mega::NT;
  out[1] = static_cast<long long>(SMEM);
  out[2] = static_cast<long long>(sizeof(Conv)) * 100 + CONV_K;
  out[3] = static_cast<long long>(sizeof(Moe)) * 10000 + MOE_MAX_E * 100 + MOE_MAX_K;
  out[4] = static_cast<long long>(sizeof(Pre)) * 100 + PRE_MAX_W;
  out[5] = static_cast<long long>(sizeof(Gdn)) * 100000 + GDN_D * 1000 + GDN_ROWS;
  out[6] = static_cast<long long>(sizeof(Down)) * 1000 + DOWN_ROWS;
  out[7] = static_cast<long long>(sizeof(Next));
  out[8] = static_cast<long long>(sizeof(Router));
}
