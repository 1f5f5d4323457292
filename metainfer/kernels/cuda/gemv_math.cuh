// Part of gemv.cu (one translation unit: gemv.cu includes its parts in order): the CTA's warps, the reductions
// over them, x's layout in shared memory, and the wgmma dot of a 16-row e4m3 chunk with x as two e4m3 terms.
#pragma once

#include <cuda_bf16.h>

#include "ptx.cuh"

namespace gemv {
constexpr int NCW = 8;              // consumer warps per CTA
constexpr int NT = 32 * (NCW + 1);  // threads per CTA: the consumers and the producer warp
constexpr int CT = 32 * NCW;        // consumer threads

// x lives in shared memory permuted per 512-column group: lane L's 16 columns (base + L * 16 + q * 4 + t)
// are read as float4 q by the 32 lanes at consecutive addresses.
__device__ __forceinline__ int xpos(int e) {
  return (e & ~511) | (((e & 15) >> 2) << 7) | (((e >> 4) & 31) << 2) | (e & 3);
}

// one try of an mbarrier's phase wait (the watchdog's loop: gemv_sync.cuh)
__device__ __forceinline__ bool bar_try(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// the consumers' sum of v (every consumer thread gets it; warp order, then lane butterflies)
__device__ float block_sum(float v, float* red, int cw, int lane) {
  v = warp_sum(v);
  consumers_sync(CT);
  if (lane == 0) red[cw] = v;
  consumers_sync(CT);
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < NCW; ++w) t += red[w];
  return t;
}

// A 16-row chunk of K = 2048 e4m3 is A of m64n8k32: W's row-major [16, 2048] viewed as [64, 512] (view row
// m = 4 r + s: W row r's K segment s), landed by TMA as 4 K blocks of [64][128 B], 128-byte swizzled (the
// canonical K-major A). B is x as two e4m3 terms in 8 columns, n = 2 s + h (segment s, hi h = 0 or lo h = 1;
// no swizzle, [512 / 16][8][16 B]): hi = e4m3(x 2^e), lo = e4m3(x 2^e - hi), with one power of two 2^e per 128
// columns setting the block's largest into [128, 256). hi + lo is exact for bf16 x down to 2^-9 of the block's
// largest (smaller ones lose bits in e4m3's subnormals). D[m][n] is used where n / 2 = m % 4.
constexpr int X8_K = 2048;  // the K staged as two e4m3 terms

// A lane's 4 columns (c0..c0 + 3) of a 128-column block of x (fp32, permuted: xpos keeps them together) as two e4m3
// terms, 4 bytes each (hi, lo), scaled by the block's power of two (its largest into [128, 256): a warp max, so the
// whole warp calls it for one block) -> 2^-e, the factor that undoes it
__device__ __forceinline__ float x8_terms(const float* xs, int c0, uint32_t& hi, uint32_t& lo) {
  const float4 v4 = *reinterpret_cast<const float4*>(xs + xpos(c0));
  const float v[4] = {v4.x, v4.y, v4.z, v4.w};
  const float m = warp_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
  const int e = static_cast<int>((__float_as_uint(m) >> 23) & 0xffu) - 127;
  const int sh = m > 0.f ? min(max(7 - e, -120), 120) : 0;
  const float up = __uint_as_float(static_cast<uint32_t>(127 + sh) << 23);
  hi = 0, lo = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float xv = v[i] * up;
    const __nv_fp8_storage_t h = __nv_cvt_float_to_fp8(xv, __NV_SATFINITE, __NV_E4M3);
    const float hv = __half2float(__half(__nv_cvt_fp8_to_halfraw(h, __NV_E4M3)));
    hi |= static_cast<uint32_t>(h) << (8 * i);
    lo |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(xv - hv, __NV_SATFINITE, __NV_E4M3)) << (8 * i);
  }
  return __uint_as_float(static_cast<uint32_t>(127 - sh) << 23);
}

// xs (fp32, permuted: xpos) -> B's two terms b8 and the blocks' 2^-e xf (warp cw: blocks cw and cw + 8, lane 4
// columns of each); made visible to wgmma (the caller's barrier follows)
__device__ void stage_x8(const float* xs, uint8_t* b8, float* xf, int cw, int lane) {
  for (int b = cw; b < X8_K / 128; b += NCW) {
    const int c0 = b * 128 + lane * 4;
    uint32_t hi, lo;
    const float f = x8_terms(xs, c0, hi, lo);
    const int sg = c0 / 512, kk = c0 % 512, at = (kk / 16) * 128 + 2 * sg * 16 + kk % 16;
    *reinterpret_cast<uint32_t*>(b8 + at) = hi;
    *reinterpret_cast<uint32_t*>(b8 + at + 16) = lo;
    if (lane == 0) xf[b] = f;
  }
  fence_proxy_async();
}

// One chunk's 16 dots on the calling warpgroup (warps w4 = 0..3 of it, all converged): ws the chunk's 16 block
// scales, b8 and xf x's terms and powers of two (stage_x8). -> on lanes 0 and 16 of warp w4: rows 4 w4 + lane / 16
// (.x) and that + 2 (.y)
__device__ __forceinline__ float2 wg_dot16(const uint8_t* chunk, const float* ws, const uint8_t* b8, const float* xf,
                                          int lane) {
  // (the descriptors' start address field is addr >> 4, and shared addresses stay below 2^18: offsets add there)
  const uint64_t da0 = smem_desc(smem_u32(chunk), 16, 1024, 1), db0 = smem_desc(smem_u32(b8), 128, 0, 0);
  float acc[4][4];  // one chain per 128-column block of a segment (block scales per 128 columns)
  wgmma_fence();
#pragma unroll
  for (int kb = 0; kb < 4; ++kb)
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // 32 columns: +32 bytes within A's swizzled rows, B's next 2 core matrices
      const uint64_t da = da0 + ((kb * 8192 + j * 32) >> 4), db = db0 + ((kb * 8 + j * 2) * 128 >> 4);
      if (j == 0) wgmma_m64n8k32<0>(acc[kb], da, db);
      else wgmma_m64n8k32<1>(acc[kb], da, db);
    }
  wgmma_commit_wait();
  // this lane's D: view rows 16 w4 + g and + 8 (segment g % 4), columns 2 t, 2 t + 1 (segment t's hi, lo)
  const int g = lane >> 2, t = lane & 3;
  float v0 = 0.f, v1 = 0.f;
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    const float f = ws[t * 4 + kb] * xf[t * 4 + kb];
    v0 = fmaf(acc[kb][0] + acc[kb][1], f, v0);
    v1 = fmaf(acc[kb][2] + acc[kb][3], f, v1);
  }
  if ((g & 3) != t) v0 = v1 = 0.f;
#pragma unroll
  for (int o = 1; o < 16; o <<= 1)  // the 4 segments of rows 4 w4 + lane / 16 (and + 2) in each half-warp
    v0 += __shfl_xor_sync(0xffffffffu, v0, o), v1 += __shfl_xor_sync(0xffffffffu, v1, o);
  return make_float2(v0, v1);
}
}  // namespace gemv
