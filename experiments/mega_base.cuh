// The megakernel's layout and plumbing: constants, the instruction, shared memory, the watchdog, sources
// polled in batches, the reductions.
// Written as a part of the persistent megakernel (mega.cu: removed, its code at commit b4eb65f); gemv.cu includes it
// (the parts only the megakernel used are still here).
#pragma once

#include <cuda_bf16.h>

#include "../metainfer/kernels/cuda/ptx.cuh"

#ifndef MEGA_PROF
#define MEGA_PROF 0  // 1: the profiling build (launch.MegaKernel(prof=True)); see profile.py
#endif
#ifndef MEGA_MMA
#define MEGA_MMA 0  // 1: the tensor-core consumers (tile_mma; launch(mma=True) loads that build). One kind per
#endif              // build: both in one kernel cost 5 KB more code, and the step's time follows code (KB-0077)
#ifndef MEGA_WGMMA
#define MEGA_WGMMA 1  // the e4m3 GEMVs of K = 2048 and the experts' gate/up on FP8 wgmma (W as A, x as two e4m3
#endif                // terms: mega_math.cuh's wg_dot16); 0: on the CUDA cores (or mma.sync: MEGA_MMA)
#ifndef MEGA_EVICT_FIRST
#define MEGA_EVICT_FIRST 1  // 1: the weight stream (the producer's copies, read once a step) evict-first in L2, so
#endif                      // that what the hops reuse stays (KB-0081: 2.259 vs 2.308 ms); 0: evict-normal

namespace mega {
constexpr int NCW = 8;              // consumer warps per CTA
constexpr int NT = 32 * (NCW + 1);  // threads per CTA
constexpr int CT = 32 * NCW;        // consumer threads
constexpr int SLOT = 32768;         // bytes per ring slot
constexpr int NSLOTS = 6;
constexpr int SCALE_BYTES = 256;    // per slot: its chunk's block scales (copied with it)
constexpr int KMAX = 4608;          // floats of x
constexpr int SCRATCH = 3072;       // floats of per-op scratch
constexpr int MAX_SCORES = 1024;    // positions one attention split scores
constexpr int MAX_EXPERTS = 256;
constexpr int ROUTE_WORDS = 32;     // the routing: ids [16], weights [16]
constexpr bool MMA = MEGA_MMA != 0;  // the e4m3 dots of 16-row tiles on the tensor cores (tile_mma)
constexpr bool WGMMA = MEGA_WGMMA != 0;
constexpr int RING_ALIGN = 1024;    // the ring starts 1024-byte aligned (the 128-byte swizzle's atoms: TMA, wgmma)

enum : int32_t { OP_GEMV = 1, OP_GATE_UP = 2, OP_DOWN = 3, OP_DELTA = 4, OP_ATTEND = 5, OP_COMBINE = 6 };
enum : int32_t { W_E4M3 = 0, W_BF16 = 1 };
enum : int32_t { PRO_NONE = 0, PRO_RMSNORM = 1, PRO_ADD_RMSNORM = 2, PRO_GATED_NORM = 3 };
enum : int32_t { OUT_F32 = 0, OUT_BF16 = 1, OUT_PLAIN_F32 = 2 };
enum : int32_t { EPI_NONE = 0, EPI_CONV = 1 };
enum : int32_t { X_SRC = 0, X_VEC = 1, X_EMBED = 2 };
enum : int32_t { STEP_TOKEN = 0, STEP_POS = 1, STEP_KV_SLOT = 2, STEP_STATE_SLOT = 3, STEP_HAS_STATE = 4,
                 STEP_SEQ_LEN = 5 };

struct Instr {  // 160 bytes, program.py's 20 words
  int32_t op, out;  // out: the kind of this instruction's output words
  int32_t i[12];
  float f[2];
  uint64_t p[12];
};
static_assert(sizeof(Instr) == 160, "program.py packs 20 words");

constexpr size_t SMEM = RING_ALIGN + (size_t)NSLOTS * SLOT + NSLOTS * SCALE_BYTES + 2 * NSLOTS * sizeof(uint64_t) +
                        KMAX * sizeof(float) + SCRATCH * sizeof(float) + ROUTE_WORDS * 4;

// The watchdog. Every wait is bounded: past WAIT_LIMIT polls the first thread to give up records what it
// waited for in err[] (the program's state words 2-5: code, CTA, instruction, detail) and raises the
// abort flag there, which every other wait checks, so a broken program ends in seconds, outputs
// garbage, and says where it stalled (program.py: Program.error()).
enum : uint32_t { ERR_DATA = 1, ERR_FULL = 2, ERR_EMPTY = 3 };
constexpr uint32_t WAIT_LIMIT = 1u << 22;
#ifndef POLL_BACKOFF
#define POLL_BACKOFF 0  // 1: Source::wait backs off between polls (measured 2026-12-02: no gain; see KB-0076)
#endif
__device__ uint32_t* g_err;  // state + 2 (the same value from every CTA)

__device__ __forceinline__ bool aborted() { return *reinterpret_cast<volatile uint32_t*>(g_err) != 0; }
__device__ __noinline__ void give_up(uint32_t code, int instr, uint32_t detail) {
  if (atomicCAS(g_err, 0u, code) == 0u) {
    g_err[1] = blockIdx.x;
    g_err[2] = (uint32_t)instr;
    g_err[3] = detail;
    __threadfence();
  }
}
__device__ __shared__ int s_instr[2];  // the instruction the producer [0] and the consumers [1] are at

// The profiling build (MEGA_PROF 1) records, per CTA and instruction, PF_N words of SM cycles (clock64's low
// 32 bits): the consumers' entry, x staged, exit and chunk waits (consumer thread 0); the producer's entry,
// routing (with the L2 lead) and empty-slot waits (producer lane 0). profile.py reads them.
enum : int { PF_C_IN, PF_C_X, PF_C_OUT, PF_C_WAIT, PF_P_IN, PF_P_ROUTE, PF_P_EMPTY, PF_CHUNKS,
             PF_S1, PF_S2, PF_S3, PF_S4, PF_LAT, PF_P_SETTLED, PF_N };
// S1-S4: marks inside the x prologues (prof_mark); LAT: one L2 load's round trip at the op's entry; P_SETTLED:
// when a routing's logits were all loaded (producer lane 0)
__device__ uint32_t* g_prof;  // [gridDim.x][n_instr][PF_N], then [gridDim.x][4] (globaltimer at entry and exit)
__device__ int g_nin;
__device__ __forceinline__ uint32_t cycles() { return static_cast<uint32_t>(clock64()); }
__device__ __forceinline__ void prof_set(int instr, int f, uint32_t v) {
  if (MEGA_PROF) g_prof[((size_t)blockIdx.x * g_nin + instr) * PF_N + f] = v;
}
// (the profiling build) consumer thread 0 marks a step of an x prologue: PF_S1..PF_S4
__device__ __forceinline__ void prof_mark(int ct, int f) {
  if (MEGA_PROF && ct == 0) prof_set(s_instr[1], f, cycles());
}
// (the profiling build) the cycles one gpu-scope load of a hot word (the watchdog's) takes to come back: the
// loaded value is stored to shared memory before the second clock read, and a warp issues in order, so that
// read waits for the load. (An asm input alone does not: ptxas dropped the dependency, and the first
// version of this probe read 2 cycles.)
__device__ __shared__ uint64_t s_probe;
__device__ __forceinline__ uint32_t probe_latency() {
  uint64_t t0, t1;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0)::"memory");
  const uint64_t v = ld_relaxed_u64(g_err);
  asm volatile("st.shared.u64 [%0], %1;" ::"r"(smem_u32(&s_probe)), "l"(v) : "memory");
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t1)::"memory");
  return static_cast<uint32_t>(t1 - t0);
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// mbar_wait with the watchdog: one try inline, the rest out of line (bar_wait_slow)
__device__ __forceinline__ bool bar_try(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}
__device__ __noinline__ void bar_wait_slow(uint64_t* bar, uint32_t parity, uint32_t code, int who, uint32_t detail) {
  for (uint32_t n = 0;; ++n) {
    if (bar_try(bar, parity)) return;
    if ((n & 1023u) == 1023u && aborted()) return;
    if (n == WAIT_LIMIT) {
      give_up(code, s_instr[who], detail);
      return;
    }
  }
}
__device__ __forceinline__ void wait_bar(uint64_t* bar, uint32_t parity, uint32_t code, int who, uint32_t detail) {
  if (!bar_try(bar, parity)) bar_wait_slow(bar, parity, code, who, detail);
}

struct Smem {
  uint8_t* ring;
  float* scales;   // [NSLOTS][SCALE_BYTES / 4]: slot i's chunk's block scales
  uint64_t* full;
  uint64_t* empty;
  float* xs;       // [KMAX] x, permuted per 512 (xpos); past K: x's other forms (xh_of, x8_of)
  float* sc;       // [SCRATCH]
  uint32_t inflight;  // the most chunks the producer keeps on their way (1..NSLOTS; the rest of the ring: landed)
  int* route_p;    // the producer's routing: ids [16], weights [16] (as int bits); Down's consumers read it
};

template <typename T>
__device__ __forceinline__ T* ptr(uint64_t v) { return reinterpret_cast<T*>(v); }

__device__ __forceinline__ float bf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float bf_at(const __nv_bfloat16* p, long long e) { return __bfloat162float(p[e]); }

// x lives in shared memory permuted per 512-column group: lane L's 16 columns (base + L * 16 + q * 4 + t)
// are read as float4 q by the 32 lanes at consecutive addresses.
__device__ __forceinline__ int xpos(int e) {
  return (e & ~511) | (((e & 15) >> 2) << 7) | (((e >> 4) & 31) << 2) | (e & 3);
}

__device__ __forceinline__ float word_value(uint64_t w, int kind) {
  const uint32_t b = static_cast<uint32_t>(w);
  return kind == OUT_BF16 ? __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(b & 0xffffu)))
                          : __uint_as_float(b);
}

#ifndef MEGA_FETCH_GROUP
#define MEGA_FETCH_GROUP 3  // (9 at 2026-12-02: 2.85 ms a step; 3, with 42 KB less code: 2.60 ms; KB-0077)
#endif
constexpr int FETCH_GROUP = MEGA_FETCH_GROUP;  // polled elements in flight per thread (x's and add's loads: 6);
                                               // fewer: less unrolled code (launch.MegaKernel(defines=...))
#ifndef MEGA_NORM_GROUP
#define MEGA_NORM_GROUP 4  // the same for the RMSNorm prologues (K = 2048: all 4 of a thread's pairs at once)
#endif
#ifndef MEGA_GATED_GROUP
#define MEGA_GATED_GROUP 4  // and for the gated norm's x and z (K = 4096: 2 groups; 8: 20 KB more code, spills)
#endif
constexpr int NORM_GROUP = MEGA_NORM_GROUP, GATED_GROUP = MEGA_GATED_GROUP;

__device__ __forceinline__ bool tagged(uint64_t w, uint32_t tag) { return static_cast<uint32_t>(w >> 32) == tag; }

// the watchdog of a data poll's n-th miss: false once the step is aborted or this poll has waited `limit`
// misses (it then gives up, with `detail`)
__device__ __forceinline__ bool keep_polling(uint32_t n, uint32_t limit, uint32_t detail) {
  if ((n & 255u) == 255u && aborted()) return false;
  if (n == limit) {
    give_up(ERR_DATA, s_instr[1], detail);
    return false;
  }
  return true;
}

// word e of y polled until it carries `tag` (the slow path of Source::wait, out of line: inlined at every poll
// site it made the kernel's code several times larger)
__device__ __noinline__ uint64_t poll_until(const uint64_t* y, int e, uint32_t tag) {
  uint64_t w = ld_relaxed_u64(y + e);
  // (with the back-off: a limit about as long as the others)
  for (uint32_t n = 0; !tagged(w, tag) && keep_polling(n, POLL_BACKOFF ? WAIT_LIMIT / 64 : WAIT_LIMIT, e); ++n) {
    if (POLL_BACKOFF) __nanosleep(32u << min(n, 3u));
    w = ld_relaxed_u64(y + e);
  }
  return w;
}

// the first of w's words j < n that lacks `tag` (-1: none)
template <int M>
__device__ __forceinline__ int first_late(const uint64_t (&w)[M], int n, uint32_t tag) {
  int late = -1;
#pragma unroll
  for (int j = M - 1; j >= 0; --j)
    if (j < n && !tagged(w[j], tag)) late = j;
  return late;
}

// one source's outputs, polled until they carry this step's tag
struct Source {
  const uint64_t* y;
  int kind;
  __device__ Source(const Instr* prog, int idx, int off) : y(ptr<const uint64_t>(prog[idx].p[4]) + off),
                                                            kind(prog[idx].out) {}
  // word e once it carries `tag` (w: a first load of it)
  // With POLL_BACKOFF a miss backs off (32, 64, 128, then 256 ns between polls), in case thousands of threads
  // spinning on the same few L2 lines (the router's logits, a hop's outputs) queued up everyone else's loads;
  // measured, it did not shorten the step.
  __device__ __forceinline__ uint64_t wait(int e, uint64_t w, uint32_t tag) const {
    return tagged(w, tag) ? w : poll_until(y, e, tag);  // (a miss: out of line)
  }
  __device__ __forceinline__ float operator()(int e, uint32_t tag) const {
    return word_value(wait(e, ld_relaxed_u64(y + e), tag), kind);
  }
  // elements e0 + j * stride (j < n <= N) into v[], G loads issued before any is waited for: a thread's words
  // cost ceil(n / G) L2 round trips, not n
  template <int G = FETCH_GROUP, int N>
  __device__ __forceinline__ void fetch(int e0, int stride, int n, float (&v)[N], uint32_t tag) const {
#pragma unroll
    for (int g0 = 0; g0 < N; g0 += G) {
      uint64_t w[G];
#pragma unroll
      for (int j = 0; j < G; ++j)
        w[j] = g0 + j < N && g0 + j < n ? ld_relaxed_u64(y + e0 + (g0 + j) * stride) : 0ull;
#pragma unroll
      for (int j = 0; j < G; ++j)
        if (g0 + j < N && g0 + j < n) v[g0 + j] = word_value(wait(e0 + (g0 + j) * stride, w[j], tag), kind);
    }
  }
  // the issue half of a pair fetch: elements 2q, 2q + 1 (q = q0 + j * stride, j < n <= M / 2) in one 16-byte
  // load each (y and the offset even: program.py), all in flight -> w[2j], w[2j + 1]
  template <int M>
  __device__ __forceinline__ void issue_pairs(int q0, int stride, int n, uint64_t (&w)[M]) const {
#pragma unroll
    for (int j = 0; j < M / 2; ++j)
      if (j < n) ld_relaxed_v2(y + 2 * (q0 + j * stride), w[2 * j], w[2 * j + 1]);
  }
  // the settle half of a pair fetch (w: issue_pairs' loads): while a word lacks `tag`, wait on the first such
  // (out of line: one load in flight), then load the whole group again. A thread's pairs come from several
  // writers (other CTAs); waited for one word at a time, a group first loaded too early cost one serial round
  // trip per late word (up to 2 per pair); settled, about one after its last writer. Once the step is aborted
  // the words are left as they are.
  template <int M>
  __device__ __forceinline__ void settle_pairs(int q0, int stride, int n, uint64_t (&w)[M], uint32_t tag) const {
    for (;;) {
      const int late = first_late(w, 2 * n, tag);
      if (late < 0 || !tagged(poll_until(y, 2 * (q0 + (late / 2) * stride) + late % 2, tag), tag)) return;
      issue_pairs(q0, stride, n, w);
    }
  }
};

// an X (kind, idx, off at i[base..base+2], pointer p[3]): element e
struct XIn {
  int kind, n;
  Source src;
  const __nv_bfloat16* vec;
  __device__ XIn(const Instr* prog, const Instr& in, int base, int n_)
      : kind(in.i[base]), n(n_), src(prog, in.i[base] == X_SRC ? in.i[base + 1] : 0, in.i[base + 2]),
        vec(ptr<const __nv_bfloat16>(in.p[3])) {
    if (kind == X_EMBED) vec += (long long)ptr<const long long>(in.p[8])[STEP_TOKEN] * n;
  }
  // an instruction's source at i[base] (index), i[base + 1] (offset)
  __device__ XIn(const Instr* prog, const Instr& in, int base, int n_, int src_kind)
      : kind(src_kind), n(n_), src(prog, in.i[base], in.i[base + 1]), vec(nullptr) {}
  __device__ __forceinline__ float operator()(int e, uint32_t tag) const {
    return kind == X_SRC ? src(e, tag) : __bfloat162float(vec[e]);
  }
  // elements 2q, 2q + 1 for q = q0 + j * stride (j < n <= G) -> v[2j], v[2j + 1]: a source's in one 16-byte
  // load each, all in flight before any is waited for, then settled (Source::settle_pairs); a vector's as bf16
  // pairs
  template <int G>
  __device__ __forceinline__ void fetch_pairs(int q0, int stride, int n, float (&v)[2 * G], uint32_t tag) const {
    uint64_t w[2 * G];
    if (kind == X_SRC) {
      src.issue_pairs(q0, stride, n, w);
      src.settle_pairs(q0, stride, n, w, tag);
    }
#pragma unroll
    for (int j = 0; j < G; ++j)
      if (j < n) {
        if (kind == X_SRC) {
          v[2 * j] = word_value(w[2 * j], src.kind), v[2 * j + 1] = word_value(w[2 * j + 1], src.kind);
        } else {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(vec + 2 * (q0 + j * stride)));
          v[2 * j] = f.x, v[2 * j + 1] = f.y;
        }
      }
  }
};

// x's elements (pairs 2q, 2q + 1 for q = ct + j * CT, j < K / 512; K a multiple of 512: program.py), plus add's
// rounded to bf16 where given, G pairs at a time, every load of a group (x's and add's, 16 bytes each)
// issued before any is waited for -> into xs (fp32, permuted: xpos), or with F16 into xh (f16, in order);
// returns this thread's sum of their squares
template <int G = FETCH_GROUP, bool F16 = false>
__device__ float stage_raw(const XIn& x, const Source* add, int K, float* xs, uint32_t tag, int ct,
                           __half* xh = nullptr) {
  float ss = 0.f;
  const int m = K / (2 * CT);
  for (int g0 = 0; g0 < m; g0 += G) {
    const int n = min(G, m - g0), q0 = ct + g0 * CT;
    uint64_t wa[2 * G];
    if (add) add->issue_pairs(q0, CT, n, wa);  // (in flight while x's are fetched)
    float v[2 * G];
    x.fetch_pairs<G>(q0, CT, n, v, tag);
    if (add) add->settle_pairs(q0, CT, n, wa, tag);
#pragma unroll
    for (int j = 0; j < 2 * G; ++j)
      if (j / 2 < n) {
        const int e = 2 * (q0 + (j / 2) * CT) + j % 2;
        if (add) v[j] = bf(v[j] + word_value(wa[j], add->kind));
        if (F16) xh[e] = __float2half_rn(v[j]);
        else xs[xpos(e)] = v[j];
        ss += v[j] * v[j];
      }
    if (g0 == 0) prof_mark(ct, PF_S3);  // (x's first group)
  }
  return ss;
}

__device__ __forceinline__ void store_word(uint64_t* y, int row, float v, int kind, uint32_t tag) {
  const uint32_t bits = kind == OUT_BF16 ? static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(v)))
                                         : __float_as_uint(v);
  st_relaxed_u64(y + row, (static_cast<uint64_t>(tag) << 32) | bits);
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
}  // namespace mega
