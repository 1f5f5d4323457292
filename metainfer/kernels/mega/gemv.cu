// One decode token's FP8 projection on the megakernel's wgmma consumers, as a kernel of its own (KB-0092, KB-0094):
//   y[n] = bf16( sum_b scale[n / 128][b] * (W[n, 128 b : 128 b + 128] . x[128 b : 128 b + 128]) ),  K = 2048,
// W [N, 2048] e4m3 (N a multiple of 16), scale [ceil(N / 128), 16] fp32, x [2048] bf16, y [N] bf16.
//
// One CTA per SM (grid <= the 16-row chunks). Warp 8 lands the CTA's chunks (chunk c on CTA c % grid) by TMA into a
// ring of GEMV_SLOTS x 32 KB, each chunk as the [64, 512] view wg_dot16 takes (W's rows as [N * 4, 512], boxes of
// 64 rows, 128-byte swizzle: launch.encode_tensor_map(w, 512, 64)), with its 16 block scales (64 bytes) on the same
// mbarrier. It starts before griddepcontrol.wait: weights and scales are never written during a step, so they
// stream while the previous kernel runs (programmatic dependent launch; metainfer/kernels/pdl.py's contract).
// Warps 0-7 (two warpgroups, alternate chunks) wait for the previous kernel, release the next one, read x, split it
// into two e4m3 terms per 128-column block (mega::stage_x8: exact for bf16 down to 2^-9 of the block's largest) and
// reduce each chunk with 16 wgmma m64n8k32 (mega::wg_dot16), fp32 per block times its scale.
// n_conv > 0: the DeltaNet in_proj's decode conv as the epilogue (weight_stream._conv_epilogue's steps): columns
// n < n_conv become silu(bf16(y[n] w[n][3] + sum_j state[j][n] w[n][j])) of the bf16 output y, the conv state of
// slots[0] (zeros where !has[0]) shifted in place with y[n] last (state [S, 3, C] bf16, strides s_slot, s_k).
#include <cuda.h>  // CUtensorMap

#include "mega_math.cuh"

#ifndef GEMV_SLOTS
#define GEMV_SLOTS 6  // ring slots of 32 KB (fewer: room on the SM for the next kernel's CTAs; gemv.py's SLOTS_ENV)
#endif

namespace {
constexpr int GK = 2048, CHUNK = 16 * GK, SEG = 512, NS = GEMV_SLOTS;
static_assert(NS >= 2 && NS <= 6, "2-6 ring slots");
constexpr size_t GEMV_SMEM = 1024 + (size_t)NS * (CHUNK + 64) + SEG * 8 + (GK / 128 + GK) * sizeof(float) +
                             2 * NS * sizeof(uint64_t);
static_assert(GEMV_SMEM <= 227 * 1024, "one CTA per SM");
constexpr int CONV_K = 4;  // the DeltaNet conv's kernel size (the launcher checks it)

struct Conv {  // the conv epilogue's operands (n_conv == 0: none)
  const __nv_bfloat16* w;  // [n_conv, CONV_K]
  __nv_bfloat16* state;    // [S, CONV_K - 1, n_conv] (strides s_slot, s_k, 1)
  const long long* slots;  // [1]
  const uint8_t* has;      // [1]
  long long s_slot, s_k;
  int n_conv;
};

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
}  // namespace

extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    gemv_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws, const __nv_bfloat16* x,
              __nv_bfloat16* y, int n_rows, const Conv conv) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* ring = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);  // swizzle atoms: 1024-aligned
  float* wsc = reinterpret_cast<float*>(ring + NS * CHUNK);  // [NSLOTS][16] each chunk's block scales
  uint8_t* b8 = reinterpret_cast<uint8_t*>(wsc + NS * 16);   // [SEG / 16][8][16] x's two e4m3 terms
  float* xf = reinterpret_cast<float*>(b8 + SEG * 8);                  // [GK / 128] 2^-e per block
  float* xs = xf + GK / 128;                                           // [GK] x (fp32, permuted: mega::xpos)
  uint64_t* full = reinterpret_cast<uint64_t*>(xs + GK);
  uint64_t* empty = full + NS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_chunks = n_rows / 16, grid = gridDim.x;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NS; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 4);  // the chunk's warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == mega::NCW) {  // producer: no wait (static bytes only)
    if (lane == 0) {
      uint32_t it = 0;
      for (int c = blockIdx.x; c < n_chunks; c += grid, ++it) {
        const uint32_t slot = it % NS;
        mbar_wait(&empty[slot], ((it / NS) & 1) ^ 1);
        mbar_expect_tx(&full[slot], CHUNK + 64);
        for (int kb = 0; kb < SEG / 128; ++kb) tma_2d(ring + slot * CHUNK + kb * 8192, &wmap, kb * 128, c * 64, &full[slot]);
        bulk_load(wsc + slot * 16, ws + (size_t)(c / 8) * (GK / 128), 64, &full[slot]);
      }
    }
    return;
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
  if (threadIdx.x == 0) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  {  // x: one 16-byte load of 8 bf16 per thread, then fp32 into xs at xpos
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(x) + threadIdx.x);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int e = threadIdx.x * 8 + 2 * i;
      xs[mega::xpos(e)] = __uint_as_float(w[i] << 16);
      xs[mega::xpos(e + 1)] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  static_assert(GK == 8 * mega::CT, "one 16-byte load of x per consumer thread");
  consumers_sync(mega::CT);
  mega::stage_x8(xs, b8, xf, warp, lane);
  consumers_sync(mega::CT);
  const int wg = warp / 4, w4 = warp & 3;
  const long long slot = conv.n_conv ? conv.slots[0] : 0;  // (after the wait: the step's inputs)
  const bool has = conv.n_conv && conv.has[0] != 0;
  uint32_t it = wg;
  for (int c = blockIdx.x + wg * grid; c < n_chunks; c += 2 * grid, it += 2) {
    const uint32_t slot_i = it % NS;
    const int row = c * 16 + 4 * w4 + (lane & 3);  // lanes 0-3 store the warp's 4 rows
    const bool is_conv = lane < 4 && row < conv.n_conv;
    ConvRow cr;
    if (is_conv) cr = conv_loads(row, conv, slot, has);
    mbar_wait(&full[slot_i], (it / NS) & 1);
    const float2 v = mega::wg_dot16(ring + slot_i * CHUNK, wsc + slot_i * 16, b8, xf, lane);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot_i]);
    // wg_dot16: rows 4 w4 + {0, 1} (.x on lanes 0, 16) and 4 w4 + {2, 3} (.y on lanes 0, 16)
    const float r01 = __shfl_sync(0xffffffffu, v.x, (lane & 1) * 16), r23 = __shfl_sync(0xffffffffu, v.y, (lane & 1) * 16);
    if (lane < 4) {
      const __nv_bfloat16 yb = __float2bfloat16_rn(lane < 2 ? r01 : r23);
      y[row] = is_conv ? conv_row(yb, row, cr, conv, slot) : yb;
    }
  }
}

// the layout constants the launcher (gemv.py) must agree with
extern "C" __global__ void gemv_constants(long long* out) {
  out[0] = mega::NT;
  out[1] = static_cast<long long>(GEMV_SMEM);
  out[2] = GK;
  out[3] = static_cast<long long>(sizeof(Conv)) * 100 + CONV_K;
}
