// How fast the megakernel's consumers reduce a ring slot, measured apart from the step (mega_chunk_bench.py).
// One CTA per SM, the megakernel's threads and shared memory, its own dot code (mega_math.cuh):
//   mode 0: compute only: 8 consumer warps reduce chunks already in shared memory (6 slots reused), each warp
//           a row pair per 16-row chunk (row_dot2, K = 2048 e4m3), lane 0 storing the rows' tagged words;
//   mode 1: the same on the tensor cores (tile_mma + tile_sum, the MEGA_MMA consumers);
//   mode 2: the ring: warp 0 streams this CTA's chunks from global memory (bulk copies into NSLOTS slots on
//           mbarriers, as mega_producer.cuh does), the consumers reduce them as in mode 0;
//   mode 3: the ring with consumers that only wait for each chunk and release it (the stream's own rate).
// out[cta * 4 + 0..1]: consumer warp 0's cycles over its chunks, globaltimer ns over the same span.
#include <cuda.h>

#include "mega_math.cuh"

using namespace mega;

namespace {
constexpr int K = 2048, ROWS = SLOT / K;  // 16 rows of 2048 e4m3 per chunk
static_assert(ROWS == 16, "one row pair per consumer warp");

}  // namespace

extern "C" __global__ void __launch_bounds__(NT, 1)
    chunk_bench(const uint8_t* w, size_t w_chunks, const float* xg, const float* scales, uint64_t* y, uint64_t* out,
                uint32_t* err, int n_chunks, int mode) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  float* ws = reinterpret_cast<float*>(smem + NSLOTS * SLOT);  // [16] the chunk's scale row (K / 128)
  uint64_t* full = reinterpret_cast<uint64_t*>(ws + 64);
  uint64_t* empty = full + NSLOTS;
  float* xs = reinterpret_cast<float*>(empty + NSLOTS);
  float* red = xs + KMAX;  // tile_sum's two [NCW][16] buffers
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, ct = (int)threadIdx.x - 32, cw = warp - 1;
  if (threadIdx.x == 0) {
    g_err = err;
    for (int i = 0; i < NSLOTS; ++i) mbar_init(&full[i], 1), mbar_init(&empty[i], NCW);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int e = threadIdx.x; e < K; e += NT) xs[xpos(e)] = xg[e];
  if (threadIdx.x < K / 128) ws[threadIdx.x] = scales[threadIdx.x];
  if (mode <= 1)  // the slots' contents: this CTA's first NSLOTS chunks
    for (int i = threadIdx.x; i < NSLOTS * SLOT / 16; i += NT)
      reinterpret_cast<uint4*>(ring)[i] =
          reinterpret_cast<const uint4*>(w + ((size_t)blockIdx.x % w_chunks) * SLOT)[i % (SLOT / 16)];
  __syncthreads();
  const uint32_t tag = 1;
  if (warp == 0) {
    if (mode >= 2 && lane == 0)
      for (int it = 0; it < n_chunks; ++it) {
        const int slot = it % NSLOTS;
        mbar_wait(&empty[slot], ((it / NSLOTS) & 1) ^ 1);
        mbar_expect_tx(&full[slot], SLOT);
        const size_t c = ((size_t)blockIdx.x + (size_t)it * gridDim.x) % w_chunks;
        bulk_load(ring + slot * SLOT, w + c * SLOT, SLOT, &full[slot]);
      }
    return;
  }
  __half* xh = reinterpret_cast<__half*>(xs + 2304);
  if (mode == 1) {
    for (int e = ct; e < K; e += CT) xh[e] = __float2half_rn(xs[xpos(e)]);
    consumers_sync(CT);
  }
  const uint64_t t0 = global_ns();
  const uint32_t c0 = static_cast<uint32_t>(clock64());
  int buf = 0;
  for (int it = 0; it < n_chunks; ++it) {
    const int slot = it % NSLOTS;
    if (mode >= 2) mbar_wait(&full[slot], (it / NSLOTS) & 1);
    const uint8_t* chunk = ring + slot * SLOT;
    const int row = (blockIdx.x * n_chunks + it) * ROWS;
    if (mode == 0 || mode == 2) {
      const float2 v = row_dot2(chunk + (size_t)cw * K, chunk + (size_t)(cw + 8) * K, K, ws, ws, xs, lane);
      if (lane < 2) store_word(y, row + cw + 8 * lane, lane ? v.y : v.x, OUT_BF16, tag);
    } else if (mode == 1) {
      const float v = tile_sum(tile_mma(chunk, K, xh, ws, ws, cw, lane), red, buf, cw, lane);
      if (cw == it % NCW && lane < 16) store_word(y, row + lane, v, OUT_BF16, tag);
    }
    if (mode >= 2) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);
    }
  }
  const uint32_t c1 = static_cast<uint32_t>(clock64());
  const uint64_t t1 = global_ns();
  if (ct == 0) out[blockIdx.x * 2] = c1 - c0, out[blockIdx.x * 2 + 1] = t1 - t0;
}

// ---- the consumers on wgmma (built 2026-12-02d, not yet run: docs/megakernel.md's design) ---------------
// chunk_bench_wgmma: warps 0-7 consume (two warpgroups, each half of K), warp 8 produces. A chunk (16 rows x 2048)
// lands by 16 TMA tensor copies (box: 128 bytes of K x 16 rows, 128-byte swizzle) as [K block][row][128 B]: the
// canonical K-major layout of wgmma's B (N = the 16 rows). A is x as two e4m3 rows, hi and lo (x times 2^s per
// 128 columns, s setting the block's largest into [128, 256)), in the no-swizzle K-major layout: 8-row core
// matrices of 16 bytes of K (rows 2-7 zeros), K-adjacent ones 128 bytes apart (LBO), the 8 row groups of M = 64
// aliased (SBO 0). D's rows 0 and 1 then hold the 16 rows' dots with hi and with lo.
//   mode 4: the slots filled once, then reduced again and again (compute only);
//   mode 5: the ring from DRAM (the producer streams this CTA's chunks as in mode 2).
namespace {
constexpr int A8_BYTES = K * 8;  // 128 core matrices of 8 rows x 16 bytes

// this CTA's chunk `it` (16 rows x K) into a slot: one tensor copy per 128-byte K block
__device__ __forceinline__ void load_chunk(uint8_t* slot, const CUtensorMap* map, size_t chunk, uint64_t* bar) {
  mbar_expect_tx(bar, SLOT);
  for (int kb = 0; kb < K / 128; ++kb) tma_2d(slot + kb * 2048, map, kb * 128, (int)(chunk * ROWS), bar);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(NT, 1)
    chunk_bench_wgmma(const __grid_constant__ CUtensorMap wmap, size_t w_chunks, const float* xg,
                      const float* scales, uint64_t* y, uint64_t* out, uint32_t* err, int n_chunks, int mode) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // the 128-byte swizzle's atoms (8 rows x 128 bytes) must start 1024-byte aligned (1 KB extra requested)
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* ring = smem;                                     // NSLOTS x 32 KB
  uint8_t* a8 = smem + NSLOTS * SLOT;                       // [K / 16][8][16] x's hi (row 0) and lo (row 1)
  float* xf = reinterpret_cast<float*>(a8 + A8_BYTES);      // [K / 128] 2^-s
  float* ws = xf + K / 128;                                 // [K / 128] the chunk's weight block scales
  float* red = ws + K / 128;                                // [16] warpgroup 1's partials
  uint64_t* full = reinterpret_cast<uint64_t*>(red + 16);
  uint64_t* empty = full + NSLOTS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
  if (threadIdx.x == 0) {
    g_err = err;
    for (int i = 0; i < NSLOTS; ++i) mbar_init(&full[i], 1), mbar_init(&empty[i], NCW);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int i = threadIdx.x; i < A8_BYTES / 16; i += NT) reinterpret_cast<uint4*>(a8)[i] = make_uint4(0, 0, 0, 0);
  if (threadIdx.x < K / 128) ws[threadIdx.x] = scales[threadIdx.x];
  __syncthreads();
  if (warp < NCW) {  // x's two e4m3 terms: warp w takes blocks w and w + 8, lane 4 columns of each
    for (int b = warp; b < K / 128; b += NCW) {
      const int c0 = b * 128 + lane * 4;
      float v[4], m = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = xg[c0 + i], m = fmaxf(m, fabsf(v[i]));
      m = warp_max(m);
      const int e = static_cast<int>((__float_as_uint(m) >> 23) & 0xffu) - 127;
      const int sh = m > 0.f ? min(max(7 - e, -120), 120) : 0;
      const float up = __uint_as_float(static_cast<uint32_t>(127 + sh) << 23);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int k = c0 + i, at = (k / 16) * 128 + (k % 16);
        const float xv = v[i] * up;
        const __nv_fp8_storage_t h = __nv_cvt_float_to_fp8(xv, __NV_SATFINITE, __NV_E4M3);
        const float hv = __half2float(__half(__nv_cvt_fp8_to_halfraw(h, __NV_E4M3)));
        a8[at] = h;                                                             // row 0
        a8[at + 16] = __nv_cvt_float_to_fp8(xv - hv, __NV_SATFINITE, __NV_E4M3);  // row 1
      }
      if (lane == 0) xf[b] = __uint_as_float(static_cast<uint32_t>(127 - sh) << 23);
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // A's bytes, written by threads, to wgmma
  __syncthreads();
  const uint32_t tag = 1;
  if (warp == NCW) {  // the producer
    if (lane == 0) {
      if (mode == 4) {
        for (int s = 0; s < NSLOTS; ++s)
          load_chunk(ring + s * SLOT, &wmap, ((size_t)blockIdx.x + (size_t)s * gridDim.x) % w_chunks, &full[s]);
      } else {
        for (int it = 0; it < n_chunks; ++it) {
          const int slot = it % NSLOTS;
          mbar_wait(&empty[slot], ((it / NSLOTS) & 1) ^ 1);
          load_chunk(ring + slot * SLOT, &wmap, ((size_t)blockIdx.x + (size_t)it * gridDim.x) % w_chunks,
                     &full[slot]);
        }
      }
    }
    return;
  }
  if (mode == 4)
    for (int s = 0; s < NSLOTS; ++s) mbar_wait(&full[s], 0);
  const uint32_t a_base = smem_u32(a8);
  const uint64_t t0 = global_ns();
  const uint32_t c0 = static_cast<uint32_t>(clock64());
  for (int it = 0; it < n_chunks; ++it) {
    const int slot = it % NSLOTS;
    if (mode == 5) mbar_wait(&full[slot], (it / NSLOTS) & 1);
    const uint32_t b_base = smem_u32(ring + slot * SLOT);
    float acc[8][8];  // this warpgroup's 8 K blocks, one accumulator each
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int kb = wg * 8 + j;
#pragma unroll
      for (int s = 0; s < 4; ++s) {  // 32 columns each: A's 2 core matrices (256 bytes), B's 32 bytes of the row
        const uint64_t da = smem_desc(a_base + (kb * 8 + s * 2) * 128, 128, 0, 0);
        const uint64_t db = smem_desc(b_base + kb * 2048 + s * 32, 16, 1024, 1);
        if (s == 0) wgmma_m64n16k32<0>(acc[j], da, db);
        else wgmma_m64n16k32<1>(acc[j], da, db);
      }
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    // D's rows 0 (hi) and 1 (lo): warp 0 of the warpgroup, lanes with g = lane / 4 < 2; a lane holds the columns
    // (rows of W) 2 tig, 2 tig + 1 (d[0], d[1]) and 8 + 2 tig, 9 + 2 tig (d[4], d[5])
    float t[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float f = ws[wg * 8 + j] * xf[wg * 8 + j];
      t[0] = fmaf(acc[j][0], f, t[0]);
      t[1] = fmaf(acc[j][1], f, t[1]);
      t[2] = fmaf(acc[j][4], f, t[2]);
      t[3] = fmaf(acc[j][5], f, t[3]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) t[i] += __shfl_xor_sync(0xffffffffu, t[i], 4);  // hi + lo (lanes tig, 4 + tig)
    const int tig = lane & 3;
    const int cols[4] = {2 * tig, 2 * tig + 1, 8 + 2 * tig, 9 + 2 * tig};
    if (warp == 4 && lane < 4)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[cols[i]] = t[i];
    consumers_sync(CT);
    if (warp == 0 && lane < 4) {
      const int row = (blockIdx.x * n_chunks + it) * ROWS;
#pragma unroll
      for (int i = 0; i < 4; ++i) store_word(y, row + cols[i], t[i] + red[cols[i]], OUT_BF16, tag);
    }
    consumers_sync(CT);  // red is free again
    if (mode == 5) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);
    }
  }
  const uint32_t c1 = static_cast<uint32_t>(clock64());
  const uint64_t t1 = global_ns();
  if (threadIdx.x == 0) out[blockIdx.x * 2] = c1 - c0, out[blockIdx.x * 2 + 1] = t1 - t0;
}

// ---- wgmma with the operands swapped (2026-12-02e): W is A, x is B ---------------------------------------------
// Modes 4-5 read A (x, 64 rows of which 2 are used) from shared memory at every wgmma: 2 KB per 512 weight bytes.
// Here the weights are A instead, so each wgmma reads each weight byte once plus 256 bytes of x. A 16-row chunk
// is viewed as 64 rows of 512 bytes (W's row-major [rows, 2048] is exactly [4 rows, 512]: view row m = 4 r + s,
// W row r's K segment s). TMA lands it as 4 K blocks of [64 view rows][128 B], 128-byte swizzled (4 copies, box
// 128 B x 64 rows): the canonical K-major A of m64nNk32. B is x with N = 8 columns, n = 2 s + h: segment s of x's
// hi (h = 0) or lo (h = 1) term, no swizzle, [512 / 16][8][16]. D[m][n] is useful where n / 2 = m % 4 (the
// diagonal: a quarter of D). One warpgroup reduces a chunk (16 wgmma, 4 accumulator chains = the 4 K blocks of
// 128 per segment); the two warpgroups take alternate chunks, so no barrier between them.
//   mode 6: compute only; mode 7: the ring from DRAM by TMA (one slot released by the warpgroup's 4 warps).
namespace {
constexpr int SEG = 512, B8_BYTES = SEG * 8;  // B: 32 core matrices of 8 columns x 16 bytes

__device__ __forceinline__ void load_chunk_t(uint8_t* slot, const CUtensorMap* map, size_t chunk, uint64_t* bar) {
  mbar_expect_tx(bar, SLOT);
  for (int kb = 0; kb < SEG / 128; ++kb) tma_2d(slot + kb * 8192, map, kb * 128, (int)(chunk * 64), bar);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(NT, 1)
    chunk_bench_wgmma_t(const __grid_constant__ CUtensorMap wmap, size_t w_chunks, const float* xg,
                        const float* scales, uint64_t* y, uint64_t* out, uint32_t* err, int n_chunks, int mode) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* ring = smem;                                 // NSLOTS x 32 KB
  uint8_t* b8 = smem + NSLOTS * SLOT;                   // [SEG / 16][8][16]: x's terms, column n = 2 s + h
  float* xf = reinterpret_cast<float*>(b8 + B8_BYTES);  // [K / 128] 2^-s
  float* ws = xf + K / 128;                             // [K / 128] the chunk's weight block scales
  uint64_t* full = reinterpret_cast<uint64_t*>(ws + K / 128);
  uint64_t* empty = full + NSLOTS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
  if (threadIdx.x == 0) {
    g_err = err;
    for (int i = 0; i < NSLOTS; ++i) mbar_init(&full[i], 1), mbar_init(&empty[i], 4);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (threadIdx.x < K / 128) ws[threadIdx.x] = scales[threadIdx.x];
  float* xs = reinterpret_cast<float*>(empty + NSLOTS);  // [K] x, permuted (xpos) as in the megakernel
  for (int e = threadIdx.x; e < K; e += NT) xs[xpos(e)] = xg[e];
  __syncthreads();
  if (warp < NCW) stage_x8(xs, b8, xf, warp, lane);  // (mega_math.cuh: the megakernel's own staging)
  __syncthreads();
  const uint32_t tag = 1;
  if (warp == NCW) {
    if (lane == 0) {
      if (mode == 6) {
        for (int s = 0; s < NSLOTS; ++s)
          load_chunk_t(ring + s * SLOT, &wmap, ((size_t)blockIdx.x + (size_t)s * gridDim.x) % w_chunks, &full[s]);
      } else {
        for (int it = 0; it < n_chunks; ++it) {
          const int slot = it % NSLOTS;
          mbar_wait(&empty[slot], ((it / NSLOTS) & 1) ^ 1);
          load_chunk_t(ring + slot * SLOT, &wmap, ((size_t)blockIdx.x + (size_t)it * gridDim.x) % w_chunks,
                       &full[slot]);
        }
      }
    }
    return;
  }
  if (mode == 6)
    for (int s = 0; s < NSLOTS; ++s) mbar_wait(&full[s], 0);
  const int w4 = warp & 3;
  const uint64_t t0 = global_ns();
  const uint32_t c0 = static_cast<uint32_t>(clock64());
  for (int it = wg; it < n_chunks; it += 2) {
    const int slot = it % NSLOTS;
    if (mode == 7) mbar_wait(&full[slot], (it / NSLOTS) & 1);
    const float2 v = wg_dot16(ring + slot * SLOT, ws, b8, xf, lane);
    if (mode == 7) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);
    }
    if ((lane & 15) == 0) {  // W rows 4 w4 + lane / 16 (view rows 16 w4 + g) and + 2 (view rows + 8)
      const int row = (blockIdx.x * n_chunks + it) * ROWS + 4 * w4 + lane / 16;
      store_word(y, row, v.x, OUT_BF16, tag);
      store_word(y, row + 2, v.y, OUT_BF16, tag);
    }
  }
  const uint32_t c1 = static_cast<uint32_t>(clock64());
  const uint64_t t1 = global_ns();
  if (threadIdx.x == 0) out[blockIdx.x * 2] = c1 - c0, out[blockIdx.x * 2 + 1] = t1 - t0;
}
