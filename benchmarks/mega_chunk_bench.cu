// How fast the megakernel's consumers reduce a ring slot, measured apart from the step (mega_chunk_bench.py).
// One CTA per SM, the megakernel's threads and shared memory, its own dot code (mega_math.cuh):
//   mode 0: compute only: 8 consumer warps reduce chunks already in shared memory (6 slots reused), each warp
//           a row pair per 16-row chunk (row_dot2, K = 2048 e4m3), lane 0 storing the rows' tagged words;
//   mode 1: the same on the tensor cores (tile_mma + tile_sum, the MEGA_MMA consumers);
//   mode 2: the ring: warp 0 streams this CTA's chunks from global memory (bulk copies into NSLOTS slots on
//           mbarriers, as mega_producer.cuh does), the consumers reduce them as in mode 0;
//   mode 3: the ring with consumers that only wait for each chunk and release it (the stream's own rate).
// out[cta * 4 + 0..1]: consumer warp 0's cycles over its chunks, globaltimer ns over the same span.
#include "../metainfer/kernels/mega/mega_math.cuh"

using namespace mega;

namespace {
constexpr int K = 2048, ROWS = SLOT / K;  // 16 rows of 2048 e4m3 per chunk
static_assert(ROWS == 16, "one row pair per consumer warp");

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
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
  const uint64_t t0 = now_ns();
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
  const uint64_t t1 = now_ns();
  if (ct == 0) out[blockIdx.x * 2] = c1 - c0, out[blockIdx.x * 2 + 1] = t1 - t0;
}
