// The batch-1 decode step's skeleton as one persistent kernel: how close a prefetching megakernel
// gets to the memory-bandwidth floor when every stage depends on the whole previous stage.
//
// Stages s = 0..S-1 are chained GEMVs over e4m3 weights, K = 2048 columns each:
//   y_s[N_s] = W_s[N_s, 2048] . x_s,   x_s[k] = softsign(y_{s-1}[k] / 20)   (x_0 = 1/2; y buffers are
//   padded with zeros to >= 2048 floats)
// so stage s cannot start its arithmetic before every CTA has finished stage s-1 (a grid-wide counter
// per stage). The byte sizes follow the FP8 model per layer (40 layers): DeltaNet in_proj 25.3 MB,
// a 2 MB stage for the recurrent state, out_proj 8.4 MB, router 1 MB, the 9 experts' gate/up 18.9 MB
// and down 9.4 MB (as rows of 2048 bytes), then the lm_head (FP8, 509 MB).
//
// Each CTA (one per SM) has one producer warp that streams its row chunks of every stage into a
// shared-memory ring with 1-D bulk copies (cp.async.bulk, completing on mbarriers) and never waits
// for a dependency, except where a stage's weights are data-dependent (the experts: their loads
// wait for the router stage), and consumer warps that wait for the dependency, read x, reduce each
// chunk and release its slot. So the weights of later stages stream while a stage waits.
//
// Modes: 0 = as above; 1 = no dependencies at all (the raw streaming rate of this kernel; results
// not checked); 2 = every stage's loads wait for the previous stage (no cross-stage prefetch: what a
// launch per stage can do at best with perfect in-stage streaming). COMPUTE 0: the consumers only
// wait for each chunk and release it (the bulk copies' own rate); 1: each row's dot on the CUDA cores
// (e4m3 -> f16 -> f32, fp32 FMAs); 2: tensor cores, mma.sync m16n8k16 on e4m3 -> f16 weights (16-row
// chunks, each warp a K range) against x in f16 (column 0 of B), rows summed with fp32 atomics; 3: the
// same dots, each warp's row partials left in shared memory and summed in warp order by the chunk's
// last warp to finish (a shared counter per slot), which stores the rows: no global atomics, the same
// bits on every run; 4: the FP8 model's W8A16 arithmetic: COMPUTE 3's dots with x rounded to bf16 (exact
// in f16), fresh accumulators per 128-column block, each block's product times its weight block scale
// (real 128 x 128 block scales) and added in fp32. (mma.sync with e4m3 operands, m16n8k32, would skip
// the weights' convert, but on sm_90 ptxas emulates it: two HMMA.16816 plus unpacks of A and of B per
// instruction, seen in this file's SASS; only wgmma reads e4m3 natively.)
//
// XCH (COMPUTE 3, 4): stage outputs carry their stage's tag in the same 64-bit word as the value (the
// LL protocol's idea), so a consumer polls the data itself instead of a counter and then the data:
// one L2 round trip per transition instead of two (the counters stay for the producer's waits).
//
// L2 lead (lead, lead_wait: bytes per CTA; 0 = off): the producer also walks ahead of its loads with
// cp.async.bulk.prefetch.L2 over the chunks it will load later that do not depend on data (every stage
// but the experts), keeping at most `lead` bytes of them in flight beyond its load cursor, and up to
// `lead_wait` while it waits for a dependency (the router): the DRAM keeps streaming the next layer's
// weights through the routing bubble, and the ring later fills from L2.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o stream_chain experiments/stream_chain.cu
//   ./stream_chain [json_out]          every variant on the 241 stages (prints a table; JSON when a path is given)
//   ./stream_chain json_out single     the same bytes as one stage (the consumers' rate without transitions)
//   ./stream_chain json_out one        one mode-0 launch (for ncu)
//   ./stream_chain json_out v2         the lead and COMPUTE 3 variants only
//   ./stream_chain json_out v3         COMPUTE 4 and XCH variants
//   ./stream_chain json_out pdlsize R  40 x (a 16-row launch, an R-row launch): one projection's cost, PDL chained
//   ./stream_chain json_out pdl        the same stages as one launch each, chained by programmatic dependent
//                                      launch (PDL) in a CUDA graph, against the persistent kernel's v3 runs
//
// PDL chain (`stage_kernel`, KB-0092): stage s is its own grid of one CTA per SM (chunks as above), launched with
// the programmatic-serialization attribute, so it may start while stage s - 1 runs. Its producer loads its first
// ring slots' weights before `griddepcontrol.wait` (PRE: the weights are never written), its consumers wait, stage
// x from stage s - 1's output and reduce. `griddepcontrol.launch_dependents` is issued after the consumers' wait
// (late: at most one stage ahead, the contract of metainfer/kernels/pdl.py) or at entry (EARLY: stages run ahead as
// far as the SMs' resources allow; a data-dependent stage then polls its router stage's counter). The ring is kept
// small enough (MINB CTAs per SM) for the next stage's CTA to be resident, and loading, while this one computes.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mega_math.cuh"  // (ptx.cuh; the megakernel's wgmma GEMV: stage_kernel_wg)

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, \
              cudaGetErrorString(e_));                                                         \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

constexpr int K = 2048;         // columns of every stage (bytes per row)
constexpr int MAX_STAGES = 512;
constexpr int PAD = 32;  // one 128-byte line per stage counter: polls of one don't queue behind another's atomics

struct Stage {
  const uint8_t* w;  // [rows, K] e4m3
  const float* ws;   // [ceil(rows / 128), K / 128] block scales (COMPUTE 4)
  float* y;          // [rows] (XCH: [rows] 64-bit words, tag << 32 | value bits)
  int rows;
  int dep;           // the producer waits for this stage's counter before loading (-1: never)
};

__constant__ Stage c_stages[MAX_STAGES];

__device__ __forceinline__ float squash(float y) {  // softsign(y / 20): bounded, no vanishing gain
  const float v = 0.05f * y;
  return __fdividef(v, 1.f + fabsf(v));
}

// COMPUTE 2: a [16, K] e4m3 chunk times x (f16) on the tensor cores; warp cw takes K range cw * K / NCW.
// The dot's K order is free, so each thread's 16-byte row piece (k0 + tig * 16: four m16n8k16 steps of
// 4 bytes) stands for A's columns (tig * 2 + {0,1}, 8 + tig * 2 + {0,1}), and B (x, column 0 only)
// is taken in the same order.
template <int NCW>
__device__ __forceinline__ float2 mma_chunk(const uint8_t* chunk, const __half* xh, int cw, int lane) {
  constexpr int KW = K / NCW;
  const int g = lane >> 2, tig = lane & 3;
  float d[4][4] = {};
  const uint8_t* ra = chunk + g * K + tig * 16;
  const uint8_t* rb = chunk + (g + 8) * K + tig * 16;
  const __half* xp = xh + tig * 16;
#pragma unroll 2
  for (int k0 = cw * KW; k0 < (cw + 1) * KW; k0 += 64) mma_k64(d, ra, rb, xp, k0, g);
  // column 0 of D (lanes with tig == 0): c0 row g, c2 row g + 8
  return make_float2((d[0][0] + d[1][0]) + (d[2][0] + d[3][0]), (d[0][2] + d[1][2]) + (d[2][2] + d[3][2]));
}

// COMPUTE 4: mma_chunk's dots (f16 operands: e4m3 weights, x rounded to bf16, both exact in f16) over
// each warp's whole 128-column blocks, each block's product (fresh accumulators) times the weight block
// scale wsr[b] added in fp32. Returns rows g and g + 8 on the lanes with tig == 0.
template <int NCW>
__device__ __forceinline__ float2 mma_scaled_chunk(const uint8_t* chunk, const __half* xh, const float* wsr,
                                                   int cw, int lane) {
  constexpr int KW = K / NCW;
  static_assert(KW % 128 == 0, "whole 128-column blocks per warp");
  const int g = lane >> 2, tig = lane & 3;
  const uint8_t* ra = chunk + g * K + tig * 16;
  const uint8_t* rb = ra + 8 * K;
  const __half* xp = xh + tig * 16;
  float r0 = 0.f, r1 = 0.f;
#pragma unroll 2
  for (int b0 = cw * KW; b0 < (cw + 1) * KW; b0 += 128) {
    float d[4][4] = {};
#pragma unroll
    for (int h = 0; h < 2; ++h) mma_k64(d, ra, rb, xp, b0 + h * 64, g);
    const float sc = wsr[b0 / 128];
    r0 = fmaf((d[0][0] + d[1][0]) + (d[2][0] + d[3][0]), sc, r0);
    r1 = fmaf((d[0][2] + d[1][2]) + (d[2][2] + d[3][2]), sc, r1);
  }
  return make_float2(r0, r1);
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// COMPUTE 3, 4: a warp's row partials of a 16-row chunk (r: rows g, g + 8 on the lanes with tig == 0) into
// shared memory (red: [slot][NCW][16]); the chunk's last warp to arrive sums them in warp order (the same bits
// on every run) -> true on that warp, with row `lane`'s sum in acc (lanes < rows), its slot counter reset
template <int NCW>
__device__ __forceinline__ bool sum_chunk_rows(float2 r, float* red, uint32_t* red_cnt, int slot, int cw, int lane,
                                               int rows, float& acc) {
  const int g = lane >> 2;
  float* rp = red + (slot * NCW + cw) * 16;
  if ((lane & 3) == 0) {
    rp[g] = r.x;
    rp[g + 8] = r.y;
  }
  __threadfence_block();
  __syncwarp();
  uint32_t last = 0;
  if (lane == 0) last = atomicAdd(&red_cnt[slot], 1u) == NCW - 1;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (!last) return false;
  __threadfence_block();
  acc = 0.f;
  if (lane < rows) {
    const float* rs = red + slot * NCW * 16 + lane;
#pragma unroll
    for (int w = 0; w < NCW; ++w) acc += rs[w * 16];
  }
  if (lane == 0) red_cnt[slot] = 0;
  __syncwarp();
  return true;
}

// stage s's x (f16, for the dots): bf16(softsign(y_{s-1} / 20)), rows past stage s - 1's as 0; 1/2 at s = 0.
// Consumer threads ct = 0 .. nct - 1 (the caller synchronises them afterwards).
__device__ __forceinline__ void stage_x_f16(__half* xh, const Stage& pv, int s, int ct, int nct) {
  for (int i0 = ct * 4; i0 < K; i0 += nct * 4) {
    float v[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    if (s > 0 && i0 < pv.rows) {  // (y buffers are padded with zeros to >= K floats)
      const float4 f = __ldcg(reinterpret_cast<const float4*>(pv.y + i0));
      v[0] = squash(f.x), v[1] = squash(f.y), v[2] = squash(f.z), v[3] = squash(f.w);
    } else if (s > 0) {
      v[0] = v[1] = v[2] = v[3] = 0.f;
    }
    __half2* xh2 = reinterpret_cast<__half2*>(xh + i0);
    xh2[0] = __floats2half2_rn(bf16_round(v[0]), bf16_round(v[1]));
    xh2[1] = __floats2half2_rn(bf16_round(v[2]), bf16_round(v[3]));
  }
}

// chunk c of a stage (CH_ROWS rows) belongs to CTA c % gridDim.x
template <int CH_ROWS, int NSLOTS, int NCW, int COMPUTE, int XS, int XCH>
__global__ void __launch_bounds__(32 * (NCW + 1), 1)
    chain_kernel(int n_stages, uint32_t* done, int mode, uint32_t lead, uint32_t lead_wait, uint32_t tag) {
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int CHUNK = CH_ROWS * K;
  uint8_t* ring = smem;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + NSLOTS * CHUNK);
  uint64_t* empty = full + NSLOTS;
  float* xs = reinterpret_cast<float*>(empty + NSLOTS);  // XS: the stage's x, read from L2 once per CTA
  __half* xh = reinterpret_cast<__half*>(xs + K);        // COMPUTE 2, 3: the same in f16
  float* red = reinterpret_cast<float*>(xh + K);         // COMPUTE 3: [NSLOTS][NCW][16] row partials
  uint32_t* red_cnt = reinterpret_cast<uint32_t*>(red + NSLOTS * NCW * 16);  // [NSLOTS] warps done
  constexpr bool MMA = COMPUTE == 2 || COMPUTE == 3;
  constexpr bool SUMS = COMPUTE == 3 || COMPUTE == 4;  // rows summed in shared memory
  static_assert(!(MMA || COMPUTE == 4) || (CH_ROWS == 16 && XS && (K / NCW) % 64 == 0), "mma: 16-row chunks");
  static_assert(!XCH || COMPUTE == 4, "tagged outputs: COMPUTE 4");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t n_cta = gridDim.x;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NSLOTS; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], NCW);
      red_cnt[i] = 0;
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 0) {  // producer
    if (lane == 0) {
      // the L2 lead's cursor (stage ps, chunk pc) walks the same (stage, chunk) order as the loads;
      // pf / ld: bytes of data-independent chunks up to the cursor / loaded so far
      int ps = 0, pc = blockIdx.x;
      uint64_t pf = 0, ld = 0;
      auto walk = [&](uint64_t limit) {
        while (ps < n_stages && pf < ld + limit) {
          const Stage q = c_stages[ps];
          const int nq = (q.rows + CH_ROWS - 1) / CH_ROWS;
          if ((mode != 1 && q.dep >= 0) || pc >= nq) {  // data-dependent stage (or this CTA's last chunk)
            ++ps;
            pc = blockIdx.x;
            continue;
          }
          const uint32_t bytes = min(CH_ROWS, q.rows - pc * CH_ROWS) * K;
          if (pf >= ld) l2_prefetch(q.w + (size_t)pc * CHUNK, bytes);  // not yet loaded
          pf += bytes;
          pc += n_cta;
        }
      };
      uint32_t it = 0;
      for (int s = 0; s < n_stages; ++s) {
        const Stage st = c_stages[s];
        int dep = mode == 1 ? -1 : (mode == 2 ? s - 1 : st.dep);
        if (dep >= 0) {
          while (ld_acquire(&done[dep * PAD]) < n_cta) {
            if (lead_wait) walk(lead_wait);
            __nanosleep(32);
          }
        }
        const int n_chunks = (st.rows + CH_ROWS - 1) / CH_ROWS;
        for (int c = blockIdx.x; c < n_chunks; c += n_cta, ++it) {
          const uint32_t slot = it % NSLOTS, rnd = it / NSLOTS;
          if (lead) walk(lead);
          mbar_wait(&empty[slot], (rnd & 1) ^ 1);
          const int rows = min(CH_ROWS, st.rows - c * CH_ROWS);
          mbar_expect_tx(&full[slot], rows * K);
          bulk_load(ring + slot * CHUNK, st.w + (size_t)c * CHUNK, rows * K, &full[slot]);
          if (mode == 1 || st.dep < 0) ld += rows * K;
        }
      }
    }
    return;
  }

  // consumers: warp w (1..NCW) reduces rows w-1, w-1+NCW, ... of each chunk; lane l holds x at the
  // columns (j * 32 + l) * 16 + i (i < 16, j < 4): conflict-free 16-byte shared loads
  const int cw = warp - 1;
  float x[64];
  uint32_t it = 0;
  for (int s = 0; s < n_stages; ++s) {
    const Stage st = c_stages[s];
    if (COMPUTE == 4) {  // x rounded to bf16, stored in f16 (exact) for the dots
      const Stage pv = c_stages[s > 0 ? s - 1 : 0];
      if (!XCH && s > 0 && mode != 1 && threadIdx.x == 32) wait_count(&done[(s - 1) * PAD], n_cta);
      consumers_sync(NCW * 32);
      if (!XCH) stage_x_f16(xh, pv, s, threadIdx.x - 32, NCW * 32);
      for (int i0 = (threadIdx.x - 32) * 4; XCH && i0 < K; i0 += NCW * 32 * 4) {  // the tagged words, polled
        float v[4] = {0.5f, 0.5f, 0.5f, 0.5f};
        if (s > 0 && i0 < pv.rows) {  // rows past pv.rows: 0 (padding)
          const uint32_t want = tag + s - 1;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint64_t w = 0;  // past pv.rows (514 router rows): never written, 0
            if (i0 + j < pv.rows) {
              do w = ld_relaxed_u64(reinterpret_cast<const uint64_t*>(pv.y) + i0 + j);
              while (static_cast<uint32_t>(w >> 32) != want);
            }
            v[j] = squash(__uint_as_float(static_cast<uint32_t>(w)));
          }
        } else if (s > 0) {
          v[0] = v[1] = v[2] = v[3] = 0.f;
        }
        __half2* xh2 = reinterpret_cast<__half2*>(xh + i0);
        xh2[0] = __floats2half2_rn(bf16_round(v[0]), bf16_round(v[1]));
        xh2[1] = __floats2half2_rn(bf16_round(v[2]), bf16_round(v[3]));
      }
      consumers_sync(NCW * 32);
    } else if (s == 0) {
#pragma unroll
      for (int i = 0; i < 64; ++i) x[i] = 0.5f;
      for (int i = threadIdx.x - 32; MMA && i < K; i += NCW * 32) xh[i] = __float2half(0.5f);
      consumers_sync(NCW * 32);
    } else {
      if (mode != 1 && threadIdx.x == 32) wait_count(&done[(s - 1) * PAD], n_cta);
      consumers_sync(NCW * 32);
      const float4* py = reinterpret_cast<const float4*>(c_stages[s - 1].y);
      if (XS) {  // one coalesced read of x per CTA (every warp reading all of it: 528 warps on 8 KB of L2)
        float4* x4 = reinterpret_cast<float4*>(xs);
        for (int i = threadIdx.x - 32; i < K / 4; i += NCW * 32) {
          const float4 v = __ldcg(py + i);
          x4[i] = make_float4(squash(v.x), squash(v.y), squash(v.z), squash(v.w));
          if (MMA) {
            reinterpret_cast<__half2*>(xh)[2 * i] = __floats2half2_rn(x4[i].x, x4[i].y);
            reinterpret_cast<__half2*>(xh)[2 * i + 1] = __floats2half2_rn(x4[i].z, x4[i].w);
          }
        }
        consumers_sync(NCW * 32);
        py = reinterpret_cast<const float4*>(xs);
      }
#pragma unroll
      for (int j = 0; j < 4 * (COMPUTE == 1); ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 v = XS ? py[(j * 32 + lane) * 4 + i] : __ldcg(py + (j * 32 + lane) * 4 + i);
          x[j * 16 + 4 * i] = XS ? v.x : squash(v.x);
          x[j * 16 + 4 * i + 1] = XS ? v.y : squash(v.y);
          x[j * 16 + 4 * i + 2] = XS ? v.z : squash(v.z);
          x[j * 16 + 4 * i + 3] = XS ? v.w : squash(v.w);
        }
    }
    const int n_chunks = (st.rows + CH_ROWS - 1) / CH_ROWS;
    for (int c = blockIdx.x; c < n_chunks; c += n_cta, ++it) {
      const uint32_t slot = it % NSLOTS, rnd = it / NSLOTS;
      mbar_wait(&full[slot], rnd & 1);
      const uint8_t* chunk = ring + slot * CHUNK;
      const int rows = min(CH_ROWS, st.rows - c * CH_ROWS);
      if (MMA || COMPUTE == 4) {
        const float2 r = COMPUTE == 4
                             ? mma_scaled_chunk<NCW>(chunk, xh, st.ws + (c * CH_ROWS / 128) * (K / 128), cw, lane)
                             : mma_chunk<NCW>(chunk, xh, cw, lane);
        const int g = lane >> 2;
        float* y = st.y + c * CH_ROWS;
        if (COMPUTE == 2 && (lane & 3) == 0) {
          if (g < rows) atomicAdd(y + g, r.x);
          if (g + 8 < rows) atomicAdd(y + g + 8, r.y);
        }
        float acc;
        if (SUMS && sum_chunk_rows<NCW>(r, red, red_cnt, slot, cw, lane, rows, acc) && lane < rows) {
          if (XCH)
            st_relaxed_u64(reinterpret_cast<uint64_t*>(st.y) + c * CH_ROWS + lane,
                           (static_cast<uint64_t>(tag + s) << 32) | __float_as_uint(acc));
          else
            y[lane] = acc;
        }
      }
      for (int r = cw; COMPUTE == 1 && r < rows; r += NCW) {
        float a4[4] = {0.f, 0.f, 0.f, 0.f};  // four chains: the FMAs' latency overlaps
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint4 v = *reinterpret_cast<const uint4*>(chunk + r * K + (j * 32 + lane) * 16);
          const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint32_t hv = fp8x2_to_f16x2(words[q] >> (16 * h));
              const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hv));
              a4[q] = fmaf(f.x, x[j * 16 + q * 4 + h * 2], a4[q]);
              a4[q] = fmaf(f.y, x[j * 16 + q * 4 + h * 2 + 1], a4[q]);
            }
          }
        }
        float acc = (a4[0] + a4[1]) + (a4[2] + a4[3]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) st.y[c * CH_ROWS + r] = acc;
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);
    }
    consumers_sync(NCW * 32);
    if (threadIdx.x == 32) {
      __threadfence();
      atomicAdd(&done[s * PAD], 1u);
    }
  }
}

// ---- the same stages as one launch each, chained by PDL (see the header) -------------------------------------
__device__ __forceinline__ void gdc_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void gdc_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

constexpr int PDL_PRE = 1;    // flags: the producer loads before griddepcontrol.wait (else after it)
constexpr int PDL_EARLY = 2;  // flags: dependents released at entry (else after the consumers' wait)

// the PDL stage kernels' start: the ring's mbarriers (empty ones counting `releasers` arrivals), red_cnt zeroed when
// given, dependents released here when early; then the block barrier
__device__ __forceinline__ void stage_start(uint64_t* full, uint64_t* empty, int nslots, uint32_t releasers,
                                            uint32_t* red_cnt, bool early) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < nslots; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], releasers);
      if (red_cnt) red_cnt[i] = 0;
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    if (early) gdc_launch_dependents();
  }
  __syncthreads();
}

// the producer's gate before its first load: weights are never written, so they may load before the wait; not a
// data-dependent stage's, whose router stage is the one before (gate/up). The down stage's router is two back:
// launched late, this grid started after stage s - 1 passed its wait, so that router had completed; launched
// early, poll its count.
__device__ __forceinline__ void producer_gate(const Stage& st, int s, int flags, const uint32_t* done, uint32_t n_cta) {
  if (!(flags & PDL_PRE) || st.dep == s - 1) gdc_wait();
  else if (st.dep >= 0 && (flags & PDL_EARLY)) wait_count(&done[st.dep * PAD], n_cta);
}

// the producer's loop: its gate, then this CTA's chunks (c = blockIdx.x + i gridDim.x) into the ring's slots in turn,
// load(c, slot) issuing each chunk's copies on full[slot] once the slot is free
template <class Load>
__device__ __forceinline__ void produce(const Stage& st, int s, int flags, const uint32_t* done, int n_chunks,
                                        uint64_t* empty, int nslots, Load load) {
  producer_gate(st, s, flags, done, gridDim.x);
  uint32_t it = 0;
  for (int c = blockIdx.x; c < n_chunks; c += gridDim.x, ++it) {
    const uint32_t slot = it % nslots;
    mbar_wait(&empty[slot], ((it / nslots) & 1) ^ 1);
    load(c, slot);
  }
}

// stage s: 16-row chunks, chunk c on CTA c % gridDim.x; COMPUTE 0 (the consumers stage x, then only wait for
// each chunk and release it) or 4 (the W8A16 dots of chain_kernel's COMPUTE 4, rows summed in shared memory)
template <int NSLOTS, int NCW, int COMPUTE, int MINB>
__global__ void __launch_bounds__(32 * (NCW + 1), MINB) stage_kernel(int s, uint32_t* done, int flags) {
  constexpr int CH_ROWS = 16, CHUNK = CH_ROWS * K;
  static_assert(COMPUTE == 0 || COMPUTE == 4, "COMPUTE 0 or 4");
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + NSLOTS * CHUNK);
  uint64_t* empty = full + NSLOTS;
  __half* xh = reinterpret_cast<__half*>(empty + NSLOTS);
  float* red = reinterpret_cast<float*>(xh + K);  // [NSLOTS][NCW][16] row partials
  uint32_t* red_cnt = reinterpret_cast<uint32_t*>(red + NSLOTS * NCW * 16);
  const bool early = flags & PDL_EARLY;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t n_cta = gridDim.x;
  const Stage st = c_stages[s];
  const int n_chunks = (st.rows + CH_ROWS - 1) / CH_ROWS;
  stage_start(full, empty, NSLOTS, NCW, red_cnt, early);
  if (warp == 0) {  // producer
    if (lane == 0) {
      produce(st, s, flags, done, n_chunks, empty, NSLOTS, [&](int c, uint32_t slot) {
        const int rows = min(CH_ROWS, st.rows - c * CH_ROWS);
        mbar_expect_tx(&full[slot], rows * K);
        bulk_load(ring + slot * CHUNK, st.w + (size_t)c * CHUNK, rows * K, &full[slot]);
      });
    }
    return;
  }
  const int cw = warp - 1;
  gdc_wait();  // stage s - 1 complete, its outputs visible
  if (!early && threadIdx.x == 32) gdc_launch_dependents();
  stage_x_f16(xh, c_stages[s > 0 ? s - 1 : 0], s, threadIdx.x - 32, NCW * 32);
  consumers_sync(NCW * 32);
  uint32_t it = 0;
  for (int c = blockIdx.x; c < n_chunks; c += n_cta, ++it) {
    const uint32_t slot = it % NSLOTS, rnd = it / NSLOTS;
    mbar_wait(&full[slot], rnd & 1);
    if (COMPUTE == 4) {
      const int rows = min(CH_ROWS, st.rows - c * CH_ROWS);
      const float2 r = mma_scaled_chunk<NCW>(ring + slot * CHUNK, xh, st.ws + (c * CH_ROWS / 128) * (K / 128), cw,
                                             lane);
      float acc;
      if (sum_chunk_rows<NCW>(r, red, red_cnt, slot, cw, lane, rows, acc) && lane < rows)
        st.y[c * CH_ROWS + lane] = acc;
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
  }
  if (early) {  // the count a later data-dependent stage polls (launched early, it may run while this one does)
    consumers_sync(NCW * 32);
    if (threadIdx.x == 32) {
      __threadfence();
      atomicAdd(&done[s * PAD], 1u);
    }
  }
}

// The same stage on FP8 wgmma (the megakernel's consumers: mega_math.cuh's stage_x8 and wg_dot16, W as A of
// m64n8k32 landed by TMA with a 128-byte swizzle, x as two e4m3 terms): warps 0-7 are two consumer warpgroups
// taking alternate chunks, warp 8 the producer, which lands each chunk's 16 block scales with it.
template <int NSLOTS, int MINB>
__global__ void __launch_bounds__(mega::NT, MINB) stage_kernel_wg(const CUtensorMap* maps, int s, uint32_t* done,
                                                                  int flags) {
  constexpr int CHUNK = 16 * K, SEG = 512;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* ring = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);  // swizzle atoms: 1024-aligned
  float* wsc = reinterpret_cast<float*>(ring + NSLOTS * CHUNK);  // [NSLOTS][16] each chunk's block scales
  uint8_t* b8 = reinterpret_cast<uint8_t*>(wsc + NSLOTS * 16);   // [SEG / 16][8][16] x's two e4m3 terms
  float* xf = reinterpret_cast<float*>(b8 + SEG * 8);            // [K / 128] 2^-e per block
  float* xs = xf + K / 128;                                      // [K] x (fp32, permuted: mega::xpos)
  uint64_t* full = reinterpret_cast<uint64_t*>(xs + K);
  uint64_t* empty = full + NSLOTS;
  const bool early = flags & PDL_EARLY;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t n_cta = gridDim.x;
  const Stage st = c_stages[s];
  const int n_chunks = (st.rows + 15) / 16;
  stage_start(full, empty, NSLOTS, 4, nullptr, early);  // (a chunk's warpgroup releases it)
  if (warp == mega::NCW) {  // producer
    if (lane == 0) {
      produce(st, s, flags, done, n_chunks, empty, NSLOTS, [&](int c, uint32_t slot) {
        mbar_expect_tx(&full[slot], CHUNK + 64);  // (a last chunk's box past the rows lands zeros, counted)
        for (int kb = 0; kb < SEG / 128; ++kb)
          tma_2d(ring + slot * CHUNK + kb * 8192, &maps[s], kb * 128, c * 64, &full[slot]);
        bulk_load(wsc + slot * 16, st.ws + (c * 16 / 128) * (K / 128), 64, &full[slot]);
      });
    }
    return;
  }
  gdc_wait();
  if (!early && threadIdx.x == 0) gdc_launch_dependents();
  const Stage pv = c_stages[s > 0 ? s - 1 : 0];
  {  // bf16(softsign(y / 20)), as stage_x_f16: each thread's two float4 loaded before any is stored
    constexpr int NV = K / 4 / mega::CT;
    float4 v[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int e = (threadIdx.x + j * mega::CT) * 4;
      v[j] = s > 0 && e < pv.rows ? __ldcg(reinterpret_cast<const float4*>(pv.y + e)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int e = (threadIdx.x + j * mega::CT) * 4;
      const float f[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) xs[mega::xpos(e + i)] = s == 0 ? 0.5f : bf16_round(squash(f[i]));
    }
  }
  consumers_sync(mega::CT);
  mega::stage_x8(xs, b8, xf, warp, lane);
  consumers_sync(mega::CT);
  const int wg = warp / 4, w4 = warp & 3;
  uint32_t it = wg;
  for (int c = blockIdx.x + wg * n_cta; c < n_chunks; c += 2 * n_cta, it += 2) {
    const uint32_t slot = it % NSLOTS;
    mbar_wait(&full[slot], (it / NSLOTS) & 1);
    const float2 v = mega::wg_dot16(ring + slot * CHUNK, wsc + slot * 16, b8, xf, lane);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
    const int row = c * 16 + 4 * w4 + lane / 16;
    if ((lane & 15) == 0 && row < st.rows) st.y[row] = v.x;
    if ((lane & 15) == 0 && row + 2 < st.rows) st.y[row + 2] = v.y;
  }
  if (early) {
    consumers_sync(mega::CT);
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(&done[s * PAD], 1u);
    }
  }
}

// ---- host -------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t hash32(size_t i, uint32_t seed) {
  uint32_t h = (uint32_t)i * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  return h ^ (h >> 13);
}

__global__ void fill_kernel(uint8_t* w, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t h = hash32(i, seed);
    // e4m3 with exponent field <= 7 (|v| < 2): no NaN, sums stay finite
    w[i] = (uint8_t)((h & 0x80u) | (h & 0x07u) | (((h >> 8) & 0x7u) << 3));
  }
}

__global__ void fill_scales(float* s, size_t n, uint32_t seed) {  // block scales in [0.5, 2)
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    s[i] = 0.5f + 1.5f * (float)(hash32(i, seed) >> 8) / 16777216.f;
}

static float e4m3_to_float(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 0xF, m = b & 7;
  float v = e == 0 ? std::ldexp((float)m / 8.f, -6) : std::ldexp(1.f + m / 8.f, e - 7);
  return s ? -v : v;
}

struct Result {
  std::string name;
  int mode, ch_rows, nslots, ncw, compute;
  double ms, gbs, err;
};

static int g_reps = 12;
static float* g_ybuf = nullptr;
static size_t g_ysz = 0;
static uint32_t g_launch = 0;  // XCH tags: launch * 1024 + stage, never reused

// a stage's first n outputs as floats (XCH: the value halves of its tagged words)
static std::vector<float> read_y(const Stage& st, int n, bool xch) {
  std::vector<float> y((size_t)n * (xch ? 2 : 1));
  CK(cudaMemcpy(y.data(), st.y, y.size() * sizeof(float), cudaMemcpyDeviceToHost));
  if (xch)
    for (int i = 0; i < n; ++i) y[i] = y[2 * i];
  y.resize(n);
  return y;
}

// the relative error of the last layer's down stage (before the head), recomputed on the host from its gate/up
// stage's output (COMPUTE 4: the block scales and x's bf16 rounding as the device does them)
static double check_down(const std::vector<Stage>& stages, int n_stages, int COMPUTE, bool XCH) {
  const int s = n_stages - 2;
  const Stage st = stages[s], pv = stages[s - 1];
  const std::vector<float> y = read_y(st, st.rows, XCH), yp = read_y(pv, K, XCH);  // pv.rows >= K here
  std::vector<uint8_t> w((size_t)st.rows * K);
  CK(cudaMemcpy(w.data(), st.w, w.size(), cudaMemcpyDeviceToHost));
  std::vector<float> ws(((st.rows + 127) / 128) * (K / 128), 1.f);
  if (COMPUTE == 4) CK(cudaMemcpy(ws.data(), st.ws, ws.size() * sizeof(float), cudaMemcpyDeviceToHost));
  std::vector<double> xs(K);
  for (int k = 0; k < K; ++k) {
    if (COMPUTE == 4) {  // the device's float softsign, rounded to bf16 (round to nearest even)
      const float v = 0.05f * yp[k], q = v / (1.f + std::fabs(v));
      uint32_t u;
      memcpy(&u, &q, 4);
      u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
      float r;
      memcpy(&r, &u, 4);
      xs[k] = r;
    } else {
      xs[k] = 0.05 * yp[k] / (1.0 + std::fabs(0.05 * yp[k]));
    }
  }
  double num = 0, den = 0;
  for (int r = 0; r < st.rows; ++r) {
    double acc = 0;
    for (int k = 0; k < K; ++k)
      acc += (double)ws[(r / 128) * (K / 128) + k / 128] * e4m3_to_float(w[(size_t)r * K + k]) * xs[k];
    num += (acc - y[r]) * (acc - y[r]);
    den += acc * acc;
  }
  if (den == 0) {  // pdlsize's chains decay (16 inputs a big stage): x falls below f16's range, all zeros
    printf("  (check: no signal left in x at stage %d: not checked)\n", s);
    return -1;
  }
  return std::sqrt(num / den);
}

// the median over g_reps runs (the first 2 dropped as warm-up) of launch() on `stream`, timed by events, each
// after prepare() (untimed)
template <class Prepare, class Launch>
static double median_ms(cudaStream_t stream, Prepare prepare, Launch launch) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int rep = 0; rep < g_reps; ++rep) {
    prepare();
    CK(cudaEventRecord(a, stream));
    launch();
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    if (rep >= 2 || g_reps < 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ms[ms.size() / 2];
}

template <int CH_ROWS, int NSLOTS, int NCW, int COMPUTE = 1, int XS = 1, int XCH = 0>
Result run(const char* name, int mode, int n_stages, uint32_t* done, double total_bytes, int n_sm,
           const std::vector<Stage>& stages, uint32_t lead = 0, uint32_t lead_wait = 0) {
  auto kern = chain_kernel<CH_ROWS, NSLOTS, NCW, COMPUTE, XS, XCH>;
  const size_t smem = (size_t)NSLOTS * CH_ROWS * K + 2 * NSLOTS * sizeof(uint64_t) + K * sizeof(float) +
                      K * sizeof(__half) + NSLOTS * NCW * 16 * sizeof(float) + NSLOTS * sizeof(uint32_t);
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, 32 * (NCW + 1), smem));
  if (per_sm < 1) {
    fprintf(stderr, "%s: does not fit on an SM\n", name);
    exit(1);
  }
  uint32_t tag = 0;
  const auto prepare = [&] {
    CK(cudaMemset(done, 0, MAX_STAGES * PAD * sizeof(uint32_t)));
    if (COMPUTE == 2) CK(cudaMemset(g_ybuf, 0, g_ysz * sizeof(float)));  // the rows are summed by atomics
    tag = ++g_launch * 1024u;
  };
  const double med = median_ms(0, prepare, [&] {
    void* args[] = {&n_stages, &done, &mode, &lead, &lead_wait, &tag};
    CK(cudaLaunchCooperativeKernel((void*)kern, dim3(n_sm), dim3(32 * (NCW + 1)), args, smem, 0));
  });
  const double err = mode != 1 && COMPUTE ? check_down(stages, n_stages, COMPUTE, XCH) : -1;
  return Result{name, mode, CH_ROWS, NSLOTS, NCW, COMPUTE, med, total_bytes / (med * 1e-3) / 1e9, err};
}

// the stages as one launch each (PDL when pdl, flags as stage_kernel's), captured once in a CUDA graph after a
// memset of the counters; the median of g_reps replays
static CUtensorMap* g_maps = nullptr;  // stage_kernel_wg: one TMA map per stage (device memory)

// each stage's weights as [rows * 4, 512] bytes: boxes of 128 bytes x 64 rows, 128-byte swizzle (launch.py's
// encode_tensor_map for a K = 2048 GEMV's 16-row chunks); the driver's entry point found through the runtime
static void make_maps(const std::vector<Stage>& stages) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  if (!fn) {
    fprintf(stderr, "no cuTensorMapEncodeTiled\n");
    exit(1);
  }
  std::vector<CUtensorMap> maps(stages.size());
  for (size_t i = 0; i < stages.size(); ++i) {
    const cuuint64_t dims[2] = {512, (cuuint64_t)stages[i].rows * (K / 512)}, strides[1] = {512};
    const cuuint32_t box[2] = {128, 64}, elem[2] = {1, 1};
    const CUresult r = reinterpret_cast<Encode>(fn)(
        &maps[i], CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(stages[i].w), dims, strides, box, elem,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
      fprintf(stderr, "cuTensorMapEncodeTiled failed (%d) at stage %zu\n", (int)r, i);
      exit(1);
    }
  }
  CK(cudaMalloc(&g_maps, maps.size() * sizeof(CUtensorMap)));
  CK(cudaMemcpy(g_maps, maps.data(), maps.size() * sizeof(CUtensorMap), cudaMemcpyHostToDevice));
}

template <int NSLOTS, int NCW, int COMPUTE, int MINB>
Result run_pdl(const char* name, int pdl, int flags, int n_stages, uint32_t* done, double total_bytes, int n_sm,
               const std::vector<Stage>& stages) {
  constexpr bool WG = COMPUTE == 5;  // stage_kernel_wg (FP8 wgmma), NCW 8
  static_assert(!WG || NCW == 8, "the wgmma consumers are two warpgroups");
  void* kern = WG ? (void*)stage_kernel_wg<NSLOTS, MINB> : (void*)stage_kernel<NSLOTS, NCW, WG ? 0 : COMPUTE, MINB>;
  const size_t smem = WG ? 1024 + (size_t)NSLOTS * (16 * K + 64) + 512 * 8 + (K / 128 + K) * sizeof(float) +
                               2 * NSLOTS * sizeof(uint64_t)
                         : (size_t)NSLOTS * 16 * K + 2 * NSLOTS * sizeof(uint64_t) + K * sizeof(__half) +
                               NSLOTS * NCW * 16 * sizeof(float) + NSLOTS * sizeof(uint32_t);
  if (WG && !g_maps) make_maps(stages);
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, 32 * (NCW + 1), smem));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  CK(cudaMemsetAsync(done, 0, MAX_STAGES * PAD * sizeof(uint32_t), stream));
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  for (int s = 0; s < n_stages; ++s) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(n_sm);
    cfg.blockDim = dim3(32 * (NCW + 1));
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = pdl ? 1 : 0;
    if (WG) CK(cudaLaunchKernelEx(&cfg, stage_kernel_wg<NSLOTS, MINB>, (const CUtensorMap*)g_maps, s, done, flags));
    else CK(cudaLaunchKernelEx(&cfg, stage_kernel<NSLOTS, NCW, WG ? 0 : COMPUTE, MINB>, s, done, flags));
  }
  CK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  const double med = median_ms(stream, [] {}, [&] { CK(cudaGraphLaunch(exec, stream)); });
  const double err = COMPUTE ? check_down(stages, n_stages, 4, false) : -1;  // (5: the same sums, x in two terms)
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(stream));
  printf("  %-44s %d CTAs/SM fit, %.3f ms, check rel err %.1e\n", name, per_sm, med, err);
  // mode column: 10 + flags with PDL, 9 without (the persistent kernel's modes are 0-2)
  return Result{name, pdl ? 10 + flags : 9, 16, NSLOTS, NCW, COMPUTE, med, total_bytes / (med * 1e-3) / 1e9, err};
}

int main(int argc, char** argv) {
  int dev = 0, n_sm = 0;
  CK(cudaSetDevice(dev));
  CK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  // per layer: in_proj, the state, out_proj, router, experts gate/up (after the router), experts down
  const int layer_rows[6] = {12352, 1024, 4096, 514, 9216, 4608};
  const int layer_dep[6] = {-1, -1, -1, -1, 3, 3};  // relative: the router stage of the same layer
  const int layers = 40, lm_rows = 248320;
  std::vector<Stage> stages;
  size_t total = 0;
  for (int l = 0; l < layers; ++l)
    for (int j = 0; j < 6; ++j) {
      stages.push_back(Stage{nullptr, nullptr, nullptr, layer_rows[j], layer_dep[j] < 0 ? -1 : l * 6 + layer_dep[j]});
      total += (size_t)layer_rows[j] * K;
    }
  stages.push_back(Stage{nullptr, nullptr, nullptr, lm_rows, -1});  // the FP8 lm_head
  total += (size_t)lm_rows * K;
  const bool single = argc > 2 && std::string(argv[2]) == "single";
  if (single) {  // the same bytes as one stage: the consumers' rate without stage transitions
    int rows = 0;
    for (auto& st : stages) rows += st.rows;
    stages.assign(1, Stage{nullptr, nullptr, nullptr, rows, -1});
    stages.push_back(Stage{nullptr, nullptr, nullptr, 16, -1});  // (the check reads stage n - 2)
    stages.push_back(Stage{nullptr, nullptr, nullptr, 16, -1});
    total += 32 * K;
  }
  const bool pdlsize = argc > 3 && std::string(argv[2]) == "pdlsize";
  if (pdlsize) {  // 40 x (a 16-row stage, then one of argv[3] rows), then a 16-row stage: one projection's cost
    const int rows = atoi(argv[3]);  // with a small launch before it, as a norm before a projection
    stages.clear();
    total = 0;
    for (int l = 0; l < 40; ++l) {
      stages.push_back(Stage{nullptr, nullptr, nullptr, 16, -1});
      stages.push_back(Stage{nullptr, nullptr, nullptr, rows, -1});
      total += (size_t)(16 + rows) * K;
    }
    stages.push_back(Stage{nullptr, nullptr, nullptr, 16, -1});
    total += 16 * K;
  }
  const int n_stages = (int)stages.size();
  uint8_t* wbuf;
  CK(cudaMalloc(&wbuf, total));
  fill_kernel<<<4 * n_sm, 256>>>(wbuf, total, 12345u);
  CK(cudaGetLastError());
  size_t off = 0, ysz = 0, wsz = 0;
  for (auto& st : stages) {
    ysz += 2 * std::max(st.rows, K);  // padded: x of the next stage reads K; XCH: 64-bit words
    wsz += (size_t)((st.rows + 127) / 128) * (K / 128);
  }
  float* wsbuf;  // the block scales (COMPUTE 4): values in [0.5, 2)
  CK(cudaMalloc(&wsbuf, wsz * sizeof(float)));
  fill_scales<<<n_sm, 256>>>(wsbuf, wsz, 777u);
  CK(cudaGetLastError());
  float* ybuf;
  CK(cudaMalloc(&ybuf, ysz * sizeof(float)));
  CK(cudaMemset(ybuf, 0, ysz * sizeof(float)));
  g_ybuf = ybuf;
  g_ysz = ysz;
  size_t yoff = 0, wsoff = 0;
  for (auto& st : stages) {
    st.w = wbuf + off;
    st.ws = wsbuf + wsoff;
    st.y = ybuf + yoff;
    off += (size_t)st.rows * K;
    yoff += 2 * std::max(st.rows, K);
    wsoff += (size_t)((st.rows + 127) / 128) * (K / 128);
  }
  CK(cudaMemcpyToSymbol(c_stages, stages.data(), n_stages * sizeof(Stage)));
  uint32_t* done;
  CK(cudaMalloc(&done, MAX_STAGES * PAD * sizeof(uint32_t)));
  CK(cudaDeviceSynchronize());
  const double total_b = (double)total;
  printf("%s, %d SMs, %d stages, %.1f MB of weights (floor at 4.3 TB/s: %.3f ms)\n", prop.name, n_sm, n_stages,
         total_b / 1e6, total_b / 4.3e12 * 1e3);
  std::vector<Result> res;
  if (single) {
    res.push_back(run<8, 12, 4>("single 16KBx12 4cw", 1, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<8, 12, 8>("single 16KBx12 8cw", 1, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 4, 2>("single 32KBx6 4cw mma", 1, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 8, 2>("single 32KBx6 8cw mma", 1, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 16, 2>("single 32KBx6 16cw mma", 1, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 16, 3>("single 32KBx6 16cw mma smem-sum", 1, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 8, 3>("single 32KBx6 8cw mma smem-sum", 1, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<8, 12, 4, 0>("single 16KBx12 no-compute", 1, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 16, 4>("single 32KBx6 16cw w8a16", 1, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 8, 4>("single 32KBx6 8cw w8a16", 1, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 4, 4>("single 32KBx6 4cw w8a16", 1, n_stages, done, total_b, n_sm, stages));
  } else if (argc > 2 && std::string(argv[2]) == "v3") {  // COMPUTE 4, XCH (and the lead)
    const uint32_t KB_ = 1024;
    for (int mode : {0, 1}) {
      res.push_back(run<16, 6, 16, 4>("w8a16 16cw", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<16, 6, 8, 4>("w8a16 8cw", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<16, 6, 4, 4>("w8a16 4cw", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<16, 6, 8, 4>("w8a16 8cw lead 64K/512K", mode, n_stages, done, total_b, n_sm, stages,
                                     64 * KB_, 512 * KB_));
    }
    res.push_back(run<16, 6, 8, 4, 1, 1>("w8a16 8cw tagged", 0, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 16, 4, 1, 1>("w8a16 16cw tagged", 0, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 8, 4, 1, 1>("w8a16 8cw tagged lead 64K/512K", 0, n_stages, done, total_b, n_sm,
                                         stages, 64 * KB_, 512 * KB_));
    res.push_back(run<16, 6, 8, 4, 1, 1>("w8a16 8cw tagged lead 128K/1M", 0, n_stages, done, total_b, n_sm,
                                         stages, 128 * KB_, 1024 * KB_));
    res.push_back(run<16, 6, 8, 4, 1, 1>("w8a16 8cw tagged lead 32K/512K", 0, n_stages, done, total_b, n_sm,
                                         stages, 32 * KB_, 512 * KB_));
  } else if (argc > 2 && std::string(argv[2]) == "wgdebug") {  // stage_kernel_wg one stage at a time, synchronised
    make_maps(stages);
    const size_t smem = 1024 + (size_t)6 * (16 * K + 64) + 512 * 8 + (K / 128 + K) * sizeof(float) + 12 * 8;
    CK(cudaFuncSetAttribute(stage_kernel_wg<6, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    for (int s = 0; s < n_stages; ++s) {
      stage_kernel_wg<6, 1><<<n_sm, mega::NT, smem>>>(g_maps, s, done, PDL_PRE);
      const cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) {
        printf("wgdebug: stage %d (%d rows, dep %d) failed: %s\n", s, stages[s].rows, stages[s].dep,
               cudaGetErrorString(e));
        return 1;
      }
    }
    printf("wgdebug: all %d stages ran; check rel err %.1e\n", n_stages, check_down(stages, n_stages, 4, false));
    return 0;
  } else if (pdlsize) {
    const int P = PDL_PRE;
    res.push_back(run_pdl<3, 8, 0, 2>("pdlsize no-compute 3 slots, late, preload", 1, P, n_stages, done, total_b,
                                      n_sm, stages));
    res.push_back(run_pdl<6, 8, 4, 1>("pdlsize w8a16 6 slots, no PDL", 0, 0, n_stages, done, total_b, n_sm, stages));
    res.push_back(run_pdl<3, 8, 4, 2>("pdlsize w8a16 3 slots, late, wait first", 1, 0, n_stages, done, total_b, n_sm,
                                      stages));
    res.push_back(run_pdl<3, 8, 4, 2>("pdlsize w8a16 3 slots, late, preload", 1, P, n_stages, done, total_b, n_sm,
                                      stages));
    res.push_back(run_pdl<3, 16, 4, 1>("pdlsize w8a16 3 slots 16cw, late, preload", 1, P, n_stages, done, total_b,
                                       n_sm, stages));
    res.push_back(run_pdl<6, 16, 4, 1>("pdlsize w8a16 6 slots 16cw, late, preload", 1, P, n_stages, done, total_b,
                                       n_sm, stages));
    res.push_back(run_pdl<3, 8, 5, 2>("pdlsize wgmma 3 slots, late, preload", 1, P, n_stages, done, total_b, n_sm,
                                      stages));
    res.push_back(run_pdl<6, 8, 5, 1>("pdlsize wgmma 6 slots, late, preload", 1, P, n_stages, done, total_b, n_sm,
                                      stages));
    for (auto& r : res)
      printf("  %-44s %.2f us per (16-row launch + %s-row launch), check %.1e\n", r.name.c_str(), r.ms * 25.0, argv[3],
             r.err);
  } else if (argc > 2 && std::string(argv[2]) == "pdlwg") {  // the full chain's wgmma variants
    const int P = PDL_PRE, E = PDL_EARLY;
    res.push_back(run_pdl<6, 8, 5, 1>("pdl wgmma 6 slots, late, preload", 1, P, n_stages, done, total_b, n_sm, stages));
    res.push_back(run_pdl<6, 8, 5, 1>("pdl wgmma 6 slots, no PDL", 0, 0, n_stages, done, total_b, n_sm, stages));
    res.push_back(run_pdl<3, 8, 5, 2>("pdl wgmma 3 slots, late, preload", 1, P, n_stages, done, total_b, n_sm, stages));
    res.push_back(run_pdl<3, 8, 5, 2>("pdl wgmma 3 slots, late, wait first", 1, 0, n_stages, done, total_b, n_sm,
                                      stages));
    res.push_back(run_pdl<3, 8, 5, 2>("pdl wgmma 3 slots, early, preload", 1, P | E, n_stages, done, total_b, n_sm,
                                      stages));
  } else if (argc > 2 && std::string(argv[2]) == "pdl") {  // the PDL chain, then the persistent kernel's v3 runs
    const int P = PDL_PRE, E = PDL_EARLY;
    for (int c = 0; c < 2; ++c) {
      auto add = [&](Result r) { res.push_back(r); };
      if (c == 0) {  // no arithmetic: the chain's transitions and the stream
        add(run_pdl<6, 8, 0, 1>("pdl no-compute 6 slots, no PDL", 0, 0, n_stages, done, total_b, n_sm, stages));
        add(run_pdl<3, 8, 0, 2>("pdl no-compute 3 slots, late, wait first", 1, 0, n_stages, done, total_b, n_sm,
                                stages));
        add(run_pdl<3, 8, 0, 2>("pdl no-compute 3 slots, late, preload", 1, P, n_stages, done, total_b, n_sm, stages));
        add(run_pdl<3, 8, 0, 2>("pdl no-compute 3 slots, early, preload", 1, P | E, n_stages, done, total_b, n_sm,
                                stages));
        add(run_pdl<2, 4, 0, 3>("pdl no-compute 2 slots 4cw, early, preload", 1, P | E, n_stages, done, total_b, n_sm,
                                stages));
        add(run_pdl<6, 8, 0, 1>("pdl no-compute 6 slots, late, preload", 1, P, n_stages, done, total_b, n_sm, stages));
      } else {  // chain_kernel's COMPUTE 4 dots (W8A16 on mma.sync)
        add(run_pdl<6, 8, 4, 1>("pdl w8a16 6 slots, no PDL", 0, 0, n_stages, done, total_b, n_sm, stages));
        add(run_pdl<3, 8, 4, 2>("pdl w8a16 3 slots, late, wait first", 1, 0, n_stages, done, total_b, n_sm, stages));
        add(run_pdl<3, 8, 4, 2>("pdl w8a16 3 slots, late, preload", 1, P, n_stages, done, total_b, n_sm, stages));
        add(run_pdl<3, 8, 4, 2>("pdl w8a16 3 slots, early, preload", 1, P | E, n_stages, done, total_b, n_sm, stages));
        add(run_pdl<2, 4, 4, 3>("pdl w8a16 2 slots 4cw, early, preload", 1, P | E, n_stages, done, total_b, n_sm,
                                stages));
        add(run_pdl<3, 16, 4, 1>("pdl w8a16 3 slots 16cw, late, preload", 1, P, n_stages, done, total_b, n_sm,
                                 stages));
        add(run_pdl<6, 8, 4, 1>("pdl w8a16 6 slots, late, preload", 1, P, n_stages, done, total_b, n_sm, stages));
      }
    }
    // the persistent kernel on the same machine (v3's runs without the lead)
    res.push_back(run<8, 12, 4, 0>("persistent no-compute", 0, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 8, 4>("persistent w8a16 8cw", 0, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 16, 4>("persistent w8a16 16cw", 0, n_stages, done, total_b, n_sm, stages));
    res.push_back(run<16, 6, 8, 4>("persistent w8a16 8cw, no dependencies", 1, n_stages, done, total_b, n_sm, stages));
  } else if (argc > 2 && std::string(argv[2]) == "v2") {  // the L2 lead and COMPUTE 3 (KB-0075)
    const uint32_t KB_ = 1024;
    for (int mode : {0, 1}) {
      res.push_back(run<8, 12, 4, 0>("no-compute", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<8, 12, 4, 0>("no-compute lead 64K/512K", mode, n_stages, done, total_b, n_sm, stages,
                                     64 * KB_, 512 * KB_));
      res.push_back(run<16, 6, 16, 2>("mma 16cw atomics", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<16, 6, 16, 3>("mma 16cw smem-sum", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<16, 6, 8, 3>("mma 8cw smem-sum", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<16, 6, 16, 3>("mma 16cw smem-sum lead 64K/512K", mode, n_stages, done, total_b, n_sm,
                                      stages, 64 * KB_, 512 * KB_));
      if (mode == 0) {
        res.push_back(run<8, 12, 4, 0>("no-compute lead 0/512K", mode, n_stages, done, total_b, n_sm, stages, 0,
                                       512 * KB_));
        res.push_back(run<8, 12, 4, 0>("no-compute lead 128K/256K", mode, n_stages, done, total_b, n_sm,
                                       stages, 128 * KB_, 256 * KB_));
        res.push_back(run<8, 12, 4, 0>("no-compute lead 32K/1M", mode, n_stages, done, total_b, n_sm, stages,
                                       32 * KB_, 1024 * KB_));
        res.push_back(run<16, 6, 16, 3>("mma 16cw smem-sum lead 0/512K", mode, n_stages, done, total_b, n_sm,
                                        stages, 0, 512 * KB_));
        res.push_back(run<8, 12, 8, 1>("cuda-core 8cw lead 64K/512K", mode, n_stages, done, total_b, n_sm,
                                       stages, 64 * KB_, 512 * KB_));
      }
    }
  } else if (argc > 2) {  // one run of mode 0 (16 KB x 12, 4 consumer warps), e.g. under ncu
    g_reps = 1;
    res.push_back(run<8, 12, 4>("16KBx12 4cw", 0, n_stages, done, total_b, n_sm, stages));
  } else {
    for (int mode : {1, 0, 2}) {
      res.push_back(run<8, 12, 4, 1, 0>("16KBx12 4cw x-L2", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<8, 12, 4>("16KBx12 4cw", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<8, 12, 8>("16KBx12 8cw", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<16, 6, 8>("32KBx6 8cw", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<16, 6, 16>("32KBx6 16cw", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<16, 6, 4, 2>("32KBx6 4cw mma", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<16, 6, 8, 2>("32KBx6 8cw mma", mode, n_stages, done, total_b, n_sm, stages));
      res.push_back(run<16, 6, 16, 2>("32KBx6 16cw mma", mode, n_stages, done, total_b, n_sm, stages));
      if (mode < 2) res.push_back(run<8, 12, 4, 0>("16KBx12 4cw no-compute", mode, n_stages, done, total_b, n_sm,
                                                  stages));
    }
  }
  printf("| config | mode | ms | GB/s | %% of 4.3 TB/s | check rel err |\n|---|---|---|---|---|---|\n");
  for (auto& r : res)
    printf("| %s | %d | %.3f | %.0f | %.1f | %.1e |\n", r.name.c_str(), r.mode, r.ms, r.gbs, r.gbs / 43.0, r.err);
  if (argc > 1) {
    auto num = [](double v) {  // JSON: finite numbers only (an unchecked run has none)
      char b[32];
      snprintf(b, sizeof b, "%.3e", v);
      return std::isfinite(v) && v >= 0 ? std::string(b) : std::string("null");
    };
    FILE* f = fopen(argv[1], "w");
    fprintf(f, "{\"gpu\": \"%s\", \"sms\": %d, \"stages\": %d, \"bytes\": %.0f, \"runs\": [", prop.name, n_sm,
            n_stages, total_b);
    for (size_t i = 0; i < res.size(); ++i)
      fprintf(f, "%s{\"config\": \"%s\", \"mode\": %d, \"ch_rows\": %d, \"nslots\": %d, \"ncw\": %d, "
              "\"compute\": %d, \"ms\": %.4f, \"gbs\": %.1f, \"rel_err\": %s}", i ? ", " : "", res[i].name.c_str(),
              res[i].mode, res[i].ch_rows, res[i].nslots, res[i].ncw, res[i].compute, res[i].ms, res[i].gbs,
              num(res[i].err).c_str());
    fprintf(f, "]}\n");
    fclose(f);
  }
  return 0;
}
