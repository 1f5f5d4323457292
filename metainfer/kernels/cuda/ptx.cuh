// PTX wrappers for gemv.cu (and experiments/'s CUDA probes, which include this file):
// mbarriers, 1-D bulk and 2-D tensor copies and L2 prefetches (sm_90), gpu-scope loads and stores, the e4m3
// convert, wgmma's descriptors and its m64n8k32 e4m3 instruction (sm_90a).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_n(uint64_t* bar, uint32_t n) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t ok = 0;
  while (!ok) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
// a 2-D TMA tensor copy: the box at (c0, c1) of the tensor map at `map` (a kernel parameter, or global memory,
// 64-byte aligned) into dst, completing on bar
__device__ __forceinline__ void tma_2d(void* dst, const void* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}
// an L2 cache policy: evict first (for data read once per step, so that it does not push out what is reused),
// or (FIRST false) evict normal, as without one
template <bool FIRST>
__device__ __forceinline__ uint64_t l2_policy() {
  uint64_t pol;
  if (FIRST) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  else asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
// bulk_load and tma_2d with an L2 cache policy (pol: createpolicy's)
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
          "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(pol)
      : "memory");
}
__device__ __forceinline__ void tma_2d(void* dst, const void* map, int c0, int c1, uint64_t* bar, uint64_t pol) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar)),
      "l"(pol)
      : "memory");
}
__device__ __forceinline__ void l2_prefetch(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_u64(const void* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// two adjacent 64-bit words (16-byte aligned) in one load
__device__ __forceinline__ void ld_relaxed_v2(const void* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
__device__ __forceinline__ void st_relaxed_u64(void* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void wait_count(const uint32_t* p, uint32_t n) {
  while (ld_acquire(p) < n) __nanosleep(32);  // 132 pollers of one L2 line: back off a little
}
__device__ __forceinline__ void consumers_sync(int n_threads) {  // named barrier 1: the consumer warps only
  asm volatile("bar.sync 1, %0;" ::"r"(n_threads) : "memory");
}
// named barrier 2 + wg: the 4 warps of consumer warpgroup wg (constant ids: ptxas reserves all 16 for a variable one)
__device__ __forceinline__ void warpgroup_sync(int wg) {
  if (wg == 0) asm volatile("bar.sync 2, 128;" ::: "memory");
  else asm volatile("bar.sync 3, 128;" ::: "memory");
}
// two e4m3 values (the low 16 bits of v) -> f16x2 (one packed convert; e4m3 is exact in f16)
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// one 64-column step of a 16-row e4m3 tile into d: rows g (ra) and g + 8 (rb), this thread's 16-byte pieces
// at k0 (four m16n8k16 steps; the dot's K order is free, so each piece stands for A's columns tig * 2 + {0,1},
// 8 + tig * 2 + {0,1} of its steps), x (f16) at xp + k0 in column 0 of B (lanes with g == 0; zeros elsewhere).
// D's column 0 then holds the rows' partial dots: d[t][0] row g, d[t][2] row g + 8 (lanes with tig == 0).
__device__ __forceinline__ void mma_k64(float (&d)[4][4], const uint8_t* ra, const uint8_t* rb, const __half* xp,
                                        int k0, int g) {
  const uint4 wa = *reinterpret_cast<const uint4*>(ra + k0);
  const uint4 wb = *reinterpret_cast<const uint4*>(rb + k0);
  const uint4 x0 = *reinterpret_cast<const uint4*>(xp + k0);
  const uint4 x1 = *reinterpret_cast<const uint4*>(xp + k0 + 8);
  const uint32_t A0[4] = {wa.x, wa.y, wa.z, wa.w}, A1[4] = {wb.x, wb.y, wb.z, wb.w};
  const uint32_t X[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const uint32_t a0 = fp8x2_to_f16x2(A0[t]), a2 = fp8x2_to_f16x2(A0[t] >> 16);
    const uint32_t a1 = fp8x2_to_f16x2(A1[t]), a3 = fp8x2_to_f16x2(A1[t] >> 16);
    const uint32_t b0 = g == 0 ? X[2 * t] : 0u, b1 = g == 0 ? X[2 * t + 1] : 0u;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[t][0]), "+f"(d[t][1]), "+f"(d[t][2]), "+f"(d[t][3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// ---- wgmma (sm_90a) ----------------------------------------------------------------------------------------
// a shared-memory matrix descriptor: start address, leading and stride byte offsets, swizzle (0 none, 1 128 B)
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo, uint32_t swizzle) {
  return (uint64_t)((addr & 0x3ffff) >> 4) | ((uint64_t)((lbo & 0x3ffff) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3ffff) >> 4) << 32) | ((uint64_t)swizzle << 62);
}
// D (64 x 8, fp32: 4 per thread) (+)= A . B, K = 32, both e4m3 from descriptors; SCALE_D 0: D = A . B
template <int SCALE_D>
__device__ __forceinline__ void wgmma_m64n8k32(float (&d)[4], uint64_t da, uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, %4, %5, %6, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(da), "l"(db), "n"(SCALE_D));
}
// D (64 x 16, fp32: 8 per thread) (+)= A . B, K = 32, both e4m3 from descriptors
template <int SCALE_D>
__device__ __forceinline__ void wgmma_m64n16k32(float (&d)[8], uint64_t da, uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, %10, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(da), "l"(db), "n"(SCALE_D));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit_wait() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
// shared-memory writes by threads, made visible to the async proxy (wgmma's and TMA's reads)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
