// The batch-1 decode step as one persistent kernel (benchmarks/MEGAKERNEL.md), v0: a program of
// chained GEMV instructions, y_i = W_i . prologue_i(x_i), run by one cooperative launch of one CTA per
// SM. Built by metainfer/kernels/mega/program.py, which packs `Instr` and checks every rule below.
//
// Roles per CTA: warp 0 (lane 0) is the producer. It walks the program and streams its CTA's row
// chunks of every instruction's weights (chunk c -> CTA c mod gridDim.x) through a ring of NSLOTS
// shared-memory slots, with 1-D bulk copies completing on mbarriers. Weights never depend on the
// step's data, so it never waits for anything but a free slot. Warps 1..NCW are consumers. For each
// instruction they build x in shared memory (the source instruction's outputs, polled, then the
// prologue), then reduce each ring chunk's rows on the CUDA cores and store each row's output.
//
// Outputs are tagged 64-bit words: tag << 32 | value bits (fp32, or bf16 in the low 16 bits). The tag
// is the step's number (step_tag + 1, read at launch), so a consumer polls the data itself and stale
// words of the previous step never pass; no counter and no reset between steps. The last CTA to
// finish advances *step_tag for the next launch.
//
// Numerics follow the engine's W8A16 decode linears (weight_stream._skinny_kernel at T = 1): e4m3 (or
// bf16) weights times x in fp32, each 16-weight piece's partial sum times its 128 x 128 block scale,
// fp32 accumulation, outputs rounded to the instruction's dtype. The RMSNorm prologue is
// reference.rms_norm: x / rms(x) * (1 + w) in fp32, rounded to bf16.
//
// Rules (program.py checks them): k is a multiple of 512 and at most KMAX; a row (k or 2k bytes) divides
// SLOT; an instruction with src >= 0 reads src's outputs [src_off, src_off + k) as x, so src < i and
// src_off + k <= src.rows; y buffers are distinct.

#include <cuda_bf16.h>

#include "ptx.cuh"

namespace {
constexpr int NCW = 8;                // consumer warps per CTA
constexpr int NT = 32 * (NCW + 1);    // threads per CTA
constexpr int SLOT = 32768;           // bytes per ring slot
constexpr int NSLOTS = 6;
constexpr int KMAX = 4096;            // the widest x

enum : int32_t { OP_GEMV = 1 };
enum : int32_t { W_E4M3 = 0, W_BF16 = 1 };
enum : int32_t { PRO_NONE = 0, PRO_RMSNORM = 1 };
enum : int32_t { OUT_F32 = 0, OUT_BF16 = 1 };

struct Instr {  // 96 bytes, 12 int64 words in program.py's order
  int32_t op, wtype;
  int32_t rows, k;
  int32_t pro, out;
  int32_t src;                   // the instruction whose outputs are x; -1: x is `x`
  float eps;                     // PRO_RMSNORM
  const uint8_t* w;              // [rows, k] e4m3 or bf16, row-major
  const float* ws;               // e4m3: [ceil(rows / 128), k / 128] block scales
  const __nv_bfloat16* norm_w;   // PRO_RMSNORM: [k]
  const __nv_bfloat16* x;        // src < 0: [k], ready at launch
  uint64_t* y;                   // [rows] tagged words
  int64_t src_off;               // x = src's outputs [src_off, src_off + k)
  int64_t reserved[2];
};
static_assert(sizeof(Instr) == 96, "program.py packs 12 words");

constexpr size_t SMEM = (size_t)NSLOTS * SLOT + 2 * NSLOTS * sizeof(uint64_t) + KMAX * sizeof(float) +
                        NCW * sizeof(float);

__device__ __forceinline__ int row_bytes(const Instr& in) { return in.k * (in.wtype == W_BF16 ? 2 : 1); }
__device__ __forceinline__ int chunk_rows(const Instr& in) { return SLOT / row_bytes(in); }

// x lives in shared memory permuted per 512-column group so that lane L's 16 columns
// (base + L * 16 + q * 4 + t) are read as float4 q by all 32 lanes at consecutive addresses.
__device__ __forceinline__ int xpos(int e) {
  return (e & ~511) | (((e & 15) >> 2) << 7) | (((e >> 4) & 31) << 2) | (e & 3);
}

__device__ __forceinline__ float word_value(uint64_t w, int out) {
  const uint32_t b = static_cast<uint32_t>(w);
  return out == OUT_BF16 ? __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(b & 0xffffu)))
                         : __uint_as_float(b);
}

// x of instruction `in` into xs (fp32, permuted), after the prologue. Consumer threads only.
__device__ void stage_x(const Instr& in, const Instr* prog, uint32_t tag, float* xs, float* red, int ct, int cw,
                        int lane) {
  consumers_sync(NCW * 32);  // every warp is done reading the previous instruction's x
  const int K = in.k;
  float ss = 0.f;
  if (in.src < 0) {
    for (int e = ct; e < K; e += NCW * 32) {
      const float v = __bfloat162float(in.x[e]);
      xs[xpos(e)] = v;
      ss += v * v;
    }
  } else {
    const uint64_t* sy = prog[in.src].y + in.src_off;
    const int sout = prog[in.src].out;
    for (int e = ct; e < K; e += NCW * 32) {
      uint64_t w;
      do w = ld_relaxed_u64(sy + e);
      while (static_cast<uint32_t>(w >> 32) != tag);
      const float v = word_value(w, sout);
      xs[xpos(e)] = v;
      ss += v * v;
    }
  }
  if (in.pro == PRO_RMSNORM) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) red[cw] = ss;
    consumers_sync(NCW * 32);
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < NCW; ++w) tot += red[w];  // warp order: every thread gets the same sum
    const float r = rsqrtf(tot / K + in.eps);
    for (int e = ct; e < K; e += NCW * 32) {
      const float v = xs[xpos(e)] * r * (1.f + __bfloat162float(in.norm_w[e]));
      xs[xpos(e)] = __bfloat162float(__float2bfloat16_rn(v));
    }
  }
  consumers_sync(NCW * 32);
}

// one row's dot with x (whole warp; the result on every lane)
__device__ __forceinline__ float row_dot(const uint8_t* row, const Instr& in, const float* ws_row, const float* xs,
                                         int lane) {
  const int K = in.k;
  float acc = 0.f;
  for (int base = 0; base < K; base += 512) {
    const float4* xv = reinterpret_cast<const float4*>(xs + base) + lane;  // float4 q at xv[q * 32]
    float part = 0.f;
    if (in.wtype == W_E4M3) {
      const uint4 v = *reinterpret_cast<const uint4*>(row + base + lane * 16);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 x4 = xv[q * 32];
        const uint32_t lo = fp8x2_to_f16x2(words[q]), hi = fp8x2_to_f16x2(words[q] >> 16);
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
        part = fmaf(a.x, x4.x, part);
        part = fmaf(a.y, x4.y, part);
        part = fmaf(b.x, x4.z, part);
        part = fmaf(b.y, x4.w, part);
      }
      acc = fmaf(part, ws_row[(base + lane * 16) / 128], acc);
    } else {
      const uint4* p = reinterpret_cast<const uint4*>(row + 2 * (base + lane * 16));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v = p[h];
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
        const float4 x0 = xv[(2 * h) * 32], x1 = xv[(2 * h + 1) * 32];
        const float xs8[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[q]));
          part = fmaf(f.x, xs8[2 * q], part);
          part = fmaf(f.y, xs8[2 * q + 1], part);
        }
      }
      acc += part;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(NT, 1)
    mega_step(const Instr* __restrict__ prog, int n_instr, uint32_t* step_tag, uint32_t* done) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + NSLOTS * SLOT);
  uint64_t* empty = full + NSLOTS;
  float* xs = reinterpret_cast<float*>(empty + NSLOTS);
  float* red = xs + KMAX;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t n_cta = gridDim.x;
  const uint32_t tag = *reinterpret_cast<volatile uint32_t*>(step_tag) + 1u;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NSLOTS; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], NCW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 0) {  // producer
    if (lane == 0) {
      uint32_t it = 0;
      for (int i = 0; i < n_instr; ++i) {
        const Instr& in = prog[i];
        const int rb = row_bytes(in), rpc = chunk_rows(in);
        const int n_chunks = (in.rows + rpc - 1) / rpc;
        for (int c = blockIdx.x; c < n_chunks; c += n_cta, ++it) {
          const uint32_t slot = it % NSLOTS, rnd = it / NSLOTS;
          mbar_wait(&empty[slot], (rnd & 1) ^ 1);
          const uint32_t bytes = min(rpc, in.rows - c * rpc) * rb;
          mbar_expect_tx(&full[slot], bytes);
          bulk_load(ring + slot * SLOT, in.w + (size_t)c * rpc * rb, bytes, &full[slot]);
        }
      }
    }
  } else {  // consumers
    const int cw = warp - 1, ct = threadIdx.x - 32;
    uint32_t it = 0;
    for (int i = 0; i < n_instr; ++i) {
      const Instr in = prog[i];
      const int rb = row_bytes(in), rpc = chunk_rows(in);
      const int n_chunks = (in.rows + rpc - 1) / rpc;
      if ((int)blockIdx.x >= n_chunks) continue;  // no rows here (the same branch for every consumer warp)
      stage_x(in, prog, tag, xs, red, ct, cw, lane);
      const int kb = in.k / 128;
      for (int c = blockIdx.x; c < n_chunks; c += n_cta, ++it) {
        const uint32_t slot = it % NSLOTS, rnd = it / NSLOTS;
        mbar_wait(&full[slot], rnd & 1);
        const uint8_t* chunk = ring + slot * SLOT;
        const int rows = min(rpc, in.rows - c * rpc);
        for (int r = cw; r < rows; r += NCW) {
          const int row = c * rpc + r;
          const float* ws_row = in.wtype == W_E4M3 ? in.ws + (size_t)(row / 128) * kb : nullptr;
          const float v = row_dot(chunk + (size_t)r * rb, in, ws_row, xs, lane);
          if (lane == 0) {
            const uint32_t bits = in.out == OUT_BF16 ? static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(v)))
                                                     : __float_as_uint(v);
            st_relaxed_u64(in.y + row, (static_cast<uint64_t>(tag) << 32) | bits);
          }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the last CTA out advances the step's tag for the next launch
    __threadfence();
    if (atomicAdd(done, 1u) == n_cta - 1) {
      *done = 0;
      __threadfence();
      atomicExch(step_tag, tag);
    }
  }
}

// the constants program.py builds against (it checks them once per load): threads per CTA, dynamic
// shared memory, slot bytes, widest x, bytes per instruction
extern "C" __global__ void mega_constants(int64_t* out) {
  out[0] = NT;
  out[1] = (int64_t)SMEM;
  out[2] = SLOT;
  out[3] = KMAX;
  out[4] = (int64_t)sizeof(Instr);
}
