// One decode token's FP8 projection on the megakernel's wgmma consumers, as a kernel of its own (KB-0092, KB-0094):
//   y[n] = bf16( sum_b scale[n / 128][b] * (W[n, 128 b : 128 b + 128] . x[128 b : 128 b + 128]) ),
// W [N, K] e4m3 with K = 2048 (N a multiple of 16) or 4096 (N a multiple of 8), scale [ceil(N / 128), K / 128] fp32,
// x [K] bf16, y [N] bf16.
//
// One CTA per SM (grid <= the chunks). A chunk is 32 KB of W: 16 rows of K = 2048 or 8 of 4096, the [64, 512] view
// of W's rows as [N * K / 512, 512] (row r's 512-byte segment s at view row (K / 512) r + s). Warp 8 lands the
// CTA's chunks (chunk c on CTA c % grid) by TMA (boxes of 64 rows, 128-byte swizzle: launch.encode_tensor_map(w,
// 512, 64)) into a ring of GEMV_SLOTS x 32 KB, each with its K / 128 block scales on the same mbarrier. It starts
// before griddepcontrol.wait: weights and scales are never written during a step, so they stream while the previous
// kernel runs (programmatic dependent launch; metainfer/kernels/pdl.py's contract). Warps 0-7 (two warpgroups,
// alternate chunks) wait for the previous kernel, release the next one, read x, split it into two e4m3 terms per
// 128-column block (exact for bf16 down to 2^-9 of the block's largest) and reduce each chunk on wgmma:
//   K = 2048: mega::stage_x8 and mega::wg_dot16 (m64n8k32: B = the 4 segments' hi and lo terms);
//   K = 4096: stage_x8_wide and wg_dot_wide below (m64n16k32: B = the 8 segments' terms; built 2026-12-04d, not
//   yet run on a GPU: gemv.py serves it only with METAINFER_WGMMA_GEMV_K4096=1), x as given (the attention o_proj) or
//   the DeltaNet gated RMSNorm of core and z computed here (the out_proj: stage_gated_x, METAINFER_WGMMA_GEMV_GNORM=1).
// Each 128-column block's product (its own accumulator chain) times the weight and x block scales, summed in fp32.
//
// moe_gate_up_e4m3 (KB-0096): the same K = 2048 kernel over one token's experts' gate/up rows (routed pairs and the
// shared expert, W [E + 1, rows, 2048]): chunk c of the (top_k + 1) rows / 16 is virtual (the shared expert's first,
// then pair 0's, ...). The producer lands the shared expert's chunks before griddepcontrol.wait, then routes (the
// top_k largest router logits, lowest index on ties: routing.softmax_topk's picks), landing each routed chunk as soon
// as its pick is found; the consumers write each row's dot in fp32 (gate and up apart: the down kernel forms
// silu(gate) * up).
#include <cuda.h>  // CUtensorMap

#include "mega_math.cuh"

#ifndef GEMV_SLOTS
#define GEMV_SLOTS 6  // ring slots of 32 KB (fewer: room on the SM for the next kernel's CTAs; gemv.py's SLOTS_ENV)
#endif

namespace {
constexpr int CHUNK = 32768, SEG = 512, NS = GEMV_SLOTS;
constexpr int MOE_MAX_E = 256, MOE_MAX_K = 16;  // routing: 8 logits a lane; the picks in shared memory
static_assert(NS >= 2 && NS <= 6, "2-6 ring slots");
// shared memory for K: 1024 (alignment) + the ring and each slot's scales + B's terms (K / 2048 x 4 KB) + x's block
// powers of two and x (fp32) + the mbarriers
template <int KK>
constexpr size_t gemv_smem() {
  return 1024 + (size_t)NS * (CHUNK + KK / 128 * 4) + KK * 2 + (KK / 128 + KK) * sizeof(float) +
         2 * NS * sizeof(uint64_t) + MOE_MAX_K * sizeof(int);
}
constexpr size_t SMEM_2048 = gemv_smem<2048>(), SMEM_4096 = gemv_smem<4096>();
static_assert(SMEM_4096 <= 227 * 1024, "one CTA per SM");
constexpr int CONV_K = 4;  // the DeltaNet conv's kernel size (the launcher checks it)

struct Conv {  // the conv epilogue's operands (n_conv == 0: none)
  const __nv_bfloat16* w;  // [n_conv, CONV_K]
  __nv_bfloat16* state;    // [S, CONV_K - 1, n_conv] (strides s_slot, s_k, 1)
  const long long* slots;  // [1]
  const uint8_t* has;      // [1]
  long long s_slot, s_k;
  int n_conv;
};

struct Gnorm {  // K = 4096's optional x prologue: the DeltaNet gated RMSNorm of 32 heads of 128 (on == 0: x as given)
  const __nv_bfloat16* core;  // [32 heads, 128] (head stride s_core)
  const __nv_bfloat16* z;     // [32 heads, 128] (head stride s_z)
  const __nv_bfloat16* w;     // [128] the norm weight
  long long s_core, s_z;
  float eps;
  int on;
};

struct Moe {  // moe_gate_up_e4m3's operands
  const __nv_bfloat16* logits;  // [E + 1] the router's logits, the shared expert's gate at E
  float* gu;                    // [top_k + 1][rows] fp32: each pair's gate rows then up rows, the shared pair last
  float* tw;                    // [top_k + 1] the renormalised top-k weights, then sigmoid(gate)
  long long* ids;               // [top_k + 1] the picks, then E
  int E, top_k, rows;           // E <= MOE_MAX_E, top_k < MOE_MAX_K, rows (2 I) a multiple of 128
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

// x = gated_rms_norm(core, z) (reference.gated_rms_norm, common.gated_norm's roundings) into xs (fp32 of the bf16
// values, at mega::xpos): warp cw takes heads cw + 8 i, lane 4 of a head's 128 values
__device__ void stage_gated_x(const Gnorm& gn, float* xs, int cw, int lane) {
  for (int h = cw; h < 32; h += mega::NCW) {
    const int d0 = lane * 4;
    const uint2 cv = *reinterpret_cast<const uint2*>(gn.core + h * gn.s_core + d0);
    const uint2 zv = *reinterpret_cast<const uint2*>(gn.z + h * gn.s_z + d0);
    const uint2 wv = *reinterpret_cast<const uint2*>(gn.w + d0);
    const uint32_t cw4[2] = {cv.x, cv.y}, zw4[2] = {zv.x, zv.y}, ww4[2] = {wv.x, wv.y};
    float c[4], z[4], w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t sh = (i & 1) ? 0u : 16u;
      c[i] = __uint_as_float((cw4[i / 2] << sh) & 0xffff0000u);
      z[i] = __uint_as_float((zw4[i / 2] << sh) & 0xffff0000u);
      w[i] = __uint_as_float((ww4[i / 2] << sh) & 0xffff0000u);
    }
    const float ss = mega::warp_sum(c[0] * c[0] + c[1] * c[1] + c[2] * c[2] + c[3] * c[3]);
    const float rstd = rsqrtf(ss / 128.f + gn.eps);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // (bf16 weight and core: the weight's product rounded to bf16, common.gated_norm's MID)
      const float hv = __bfloat162float(__float2bfloat16_rn(__bfloat162float(__float2bfloat16_rn(c[i] * rstd)) * w[i]));
      const float g = z[i] / (1.f + __expf(-z[i]));
      xs[mega::xpos(h * 128 + d0 + i)] = __bfloat162float(__float2bfloat16_rn(hv * g));
    }
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
// ---- K = 4096: 8-row chunks, B as the 8 segments' two terms (16 columns) --------------------------------------
// x (fp32, permuted: mega::xpos) of K = 4096 -> B's terms b8 and the blocks' 2^-e xf, as mega::stage_x8 per 128-column
// block (warp cw: blocks cw + 8 i, lane 4 columns of each), B laid out K-major without swizzle as
// [K 512 / 16][2 column groups][8 columns][16 bytes], column n = 2 s + h (segment s, hi h = 0 or lo h = 1)
__device__ void stage_x8_wide(const float* xs, uint8_t* b8, float* xf, int cw, int lane) {
  for (int b = cw; b < 4096 / 128; b += mega::NCW) {
    const int c0 = b * 128 + lane * 4;
    uint32_t hi, lo;
    const float f = mega::x8_terms(xs, c0, hi, lo);
    const int sg = c0 / SEG, kk = c0 % SEG, n = 2 * sg;
    const int at = (kk / 16) * 256 + (n / 8) * 128 + (n % 8) * 16 + kk % 16;
    *reinterpret_cast<uint32_t*>(b8 + at) = hi;
    *reinterpret_cast<uint32_t*>(b8 + at + 16) = lo;  // (column n + 1: the same group, n even)
    if (lane == 0) xf[b] = f;
  }
  fence_proxy_async();
}

// One 8-row chunk of K = 4096 on the calling warpgroup (16 wgmma m64n16k32): ws the chunk's 32 block scales, b8 and
// xf from stage_x8_wide. D[m][n] (m = 8 r + s: row r's segment s) is used where n / 2 = s. A thread holds D's rows
// 16 w4 + g and + 8 (r = 2 w4 and 2 w4 + 1, s = g), columns 8 j + 2 t + {0, 1}: its segment's terms where
// t = g % 4, in column group j = g / 4. -> on lane 0 of warp w4: rows 2 w4 (.x) and 2 w4 + 1 (.y)
__device__ __forceinline__ float2 wg_dot_wide(const uint8_t* chunk, const float* ws, const uint8_t* b8, const float* xf,
                                             int lane) {
  const uint64_t da0 = smem_desc(smem_u32(chunk), 16, 1024, 1), db0 = smem_desc(smem_u32(b8), 256, 128, 0);
  float acc[4][8];  // one chain per 128-column block of a segment
  wgmma_fence();
#pragma unroll
  for (int kb = 0; kb < 4; ++kb)
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // 32 columns: +32 bytes within A's swizzled rows, B's next 2 K-steps of 256 bytes
      const uint64_t da = da0 + ((kb * 8192 + j * 32) >> 4), db = db0 + (((kb * 8 + j * 2) * 256) >> 4);
      if (j == 0) wgmma_m64n16k32<0>(acc[kb], da, db);
      else wgmma_m64n16k32<1>(acc[kb], da, db);
    }
  wgmma_commit_wait();
  const int g = lane >> 2, t = lane & 3;
  float v0 = 0.f, v1 = 0.f;
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    const float f = ws[g * 4 + kb] * xf[g * 4 + kb];  // segment g's block kb
    const float a0 = g < 4 ? acc[kb][0] + acc[kb][1] : acc[kb][4] + acc[kb][5];  // row g: hi + lo
    const float a1 = g < 4 ? acc[kb][2] + acc[kb][3] : acc[kb][6] + acc[kb][7];  // row g + 8
    v0 = fmaf(a0, f, v0);
    v1 = fmaf(a1, f, v1);
  }
  if ((g & 3) != t) v0 = v1 = 0.f;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1)  // the 8 segments of each row
    v0 += __shfl_xor_sync(0xffffffffu, v0, o), v1 += __shfl_xor_sync(0xffffffffu, v1, o);
  return make_float2(v0, v1);
}
}  // namespace

template <int KK, bool MOE = false>
__device__ __forceinline__ void gemv_body(const CUtensorMap* wmap, const float* __restrict__ ws,
                                          const __nv_bfloat16* x, __nv_bfloat16* y, int n_rows, const Conv& conv,
                                          const Gnorm& gnorm, const Moe& moe = Moe{}) {
  constexpr int ROWS = CHUNK / KK, NB = KK / 128;  // rows a chunk, blocks a row
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* ring = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);  // swizzle atoms: 1024-aligned
  float* wsc = reinterpret_cast<float*>(ring + NS * CHUNK);  // [NS][NB] each chunk's block scales
  uint8_t* b8 = reinterpret_cast<uint8_t*>(wsc + NS * NB);   // x's two e4m3 terms (KK * 2 bytes)
  float* xf = reinterpret_cast<float*>(b8 + KK * 2);         // [NB] 2^-e per block
  float* xs = xf + NB;                                       // [KK] x (fp32, permuted: mega::xpos)
  uint64_t* full = reinterpret_cast<uint64_t*>(xs + KK);
  uint64_t* empty = full + NS;
  int* pick = reinterpret_cast<int*>(empty + NS);  // MOE: the routed experts
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_chunks = n_rows / ROWS, grid = gridDim.x;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NS; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 4);  // the chunk's warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == mega::NCW) {  // producer: no wait (static bytes only), except for MOE's routing
    // chunk it of this CTA into its slot: W's chunk g (its rows g * ROWS..) and their block scales
    auto land = [&](uint32_t it, int g) {
      const uint32_t slot = it % NS;
      mbar_wait(&empty[slot], ((it / NS) & 1) ^ 1);
      mbar_expect_tx(&full[slot], CHUNK + NB * 4);
      for (int kb = 0; kb < SEG / 128; ++kb)
        tma_2d(ring + slot * CHUNK + kb * 8192, wmap, kb * 128, g * 64, &full[slot]);
      bulk_load(wsc + slot * NB, ws + (size_t)(g * ROWS / 128) * NB, NB * 4, &full[slot]);
    };
    int c = blockIdx.x;
    uint32_t it = 0;
    if constexpr (MOE) {
      const int cpp = moe.rows / ROWS;  // chunks a pair; virtual chunk c: pair q - 1 of c / cpp (q = 0: shared)
      for (; c < cpp; c += grid, ++it)  // the shared expert's: static
        if (lane == 0) land(it, moe.E * cpp + c);
      asm volatile("griddepcontrol.wait;" ::: "memory");  // the router's logits
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
      if (blockIdx.x == 0) {
        for (; known < moe.top_k; ++known) {
          const int e = route_next(r, lane);
          if (lane == 0) pick[known] = e;
        }
        __syncwarp();
        route_weights(moe, pick, lane);
      }
    } else if (lane == 0) {
      for (; c < n_chunks; c += grid, ++it) land(it, c);
    }
    return;
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
  if (threadIdx.x == 0) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  static_assert(KK % (8 * mega::CT) == 0, "whole 16-byte loads of x per consumer thread");
  constexpr int NV = KK / (8 * mega::CT);
  if (KK == 4096 && gnorm.on) {
    stage_gated_x(gnorm, xs, warp, lane);
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
  if (KK == 2048) mega::stage_x8(xs, b8, xf, warp, lane);
  else stage_x8_wide(xs, b8, xf, warp, lane);
  consumers_sync(mega::CT);
  const int wg = warp / 4, w4 = warp & 3;
  const long long slot = conv.n_conv ? conv.slots[0] : 0;  // (after the wait: the step's inputs)
  const bool has = conv.n_conv && conv.has[0] != 0;
  uint32_t it = wg;
  for (int c = blockIdx.x + wg * grid; c < n_chunks; c += 2 * grid, it += 2) {
    const uint32_t slot_i = it % NS;
    if (KK == 2048) {
      const int row = c * 16 + 4 * w4 + (lane & 3);  // lanes 0-3 store the warp's 4 rows
      const bool is_conv = lane < 4 && row < conv.n_conv;
      ConvRow cr;
      if (is_conv) cr = conv_loads(row, conv, slot, has);
      mbar_wait(&full[slot_i], (it / NS) & 1);
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
    } else {
      mbar_wait(&full[slot_i], (it / NS) & 1);
      const float2 v = wg_dot_wide(ring + slot_i * CHUNK, wsc + slot_i * NB, b8, xf, lane);
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(&empty[slot_i]);
        y[c * 8 + 2 * w4] = __float2bfloat16_rn(v.x);
        y[c * 8 + 2 * w4 + 1] = __float2bfloat16_rn(v.y);
      }
    }
  }
}

// K = 2048 (with the conv epilogue where conv.n_conv > 0)
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    gemv_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws, const __nv_bfloat16* x,
              __nv_bfloat16* y, int n_rows, const Conv conv) {
  gemv_body<2048>(&wmap, ws, x, y, n_rows, conv, Gnorm{});
}

// K = 4096 (conv unused: pass n_conv = 0), x given or (gnorm.on) the gated RMSNorm of core and z
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    gemv_e4m3_k4096(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws, const __nv_bfloat16* x,
                    __nv_bfloat16* y, int n_rows, const Conv conv, const Gnorm gnorm) {
  gemv_body<4096>(&wmap, ws, x, y, n_rows, conv, gnorm);
}

// one token's experts' gate/up (x: the normed hidden state), routed here from moe.logits (see the header)
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    moe_gate_up_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws,
                     const __nv_bfloat16* x, const Moe moe) {
  gemv_body<2048, true>(&wmap, ws, x, nullptr, (moe.top_k + 1) * moe.rows, Conv{}, Gnorm{}, moe);
}

// the layout constants the launcher (gemv.py) must agree with
extern "C" __global__ void gemv_constants(long long* out) {
  out[0] = mega::NT;
  out[1] = static_cast<long long>(SMEM_2048);
  out[2] = static_cast<long long>(SMEM_4096);
  out[3] = static_cast<long long>(sizeof(Conv)) * 100 + CONV_K;
  out[4] = static_cast<long long>(sizeof(Gnorm));
  out[5] = static_cast<long long>(sizeof(Moe)) * 10000 + MOE_MAX_E * 100 + MOE_MAX_K;
}
