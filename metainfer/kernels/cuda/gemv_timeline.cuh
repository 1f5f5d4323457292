// Part of gemv.cu (one translation unit: gemv.cu includes its parts in order): the timeline build
// (-DGEMV_TIMELINE=1). Each CTA of each launch writes one record of TL_N 64-bit words: SM cycles (clock64) at
// its phases, and globaltimer (ns) at its entry and its first warpgroup's end, which turn cycles into time and
// line the SMs up (gemv_timeline.py fits each SM's clock to globaltimer over a step).
//
// The record's place comes from the launch's sequence number (the host's count of gemv.cu launches, a kernel
// argument, so a CUDA graph replays each launch into its own place) and the CTA: no atomics. Every value is
// held in registers and stored when its thread is done, so the timeline adds no memory round trip before a
// chunk's wait. Off (gemv_tl null, or the default build): nothing is written.
#pragma once

#ifndef GEMV_TIMELINE
#define GEMV_TIMELINE 0
#endif

__device__ unsigned long long* gemv_tl;  // [slots][grid][TL_N] or null (gemv_set_timeline)
__device__ int gemv_tl_slots, gemv_tl_grid;

namespace {
// the record's words (gemv_timeline.py's FIELDS in this order)
enum : int {
  TL_META,       // kind (0 gemv_e4m3, 1 gemv_e4m3_pre, 2 moe_gate_up_e4m3) | grid << 4 | CTA << 16 | SM << 28 |
                 // n_rows << 40
  TL_SEQ,        // the launch's sequence number + 1 (0: no record)
  TL_GT_IN,      // globaltimer at entry (consumer thread 0)
  TL_IN,         // clock64 at entry
  TL_WAIT,       // griddepcontrol.wait returned (the previous kernel done)
  TL_ROWS,       // (pre) the MoE rows summed
  TL_STAGED,     // x in shared memory as fp32 (every consumer)
  TL_X,          // x's e4m3 terms staged: the chunks' dots can start
  TL_FIRST,      // the first chunk's slot full (warpgroup 0)
  TL_END0,       // warpgroup 0 done
  TL_WAITCYC0,   // warpgroup 0's cycles in full-slot waits
  TL_GT_END0,    // globaltimer at TL_END0
  TL_FIRST1,     // warpgroup 1's first chunk's slot full
  TL_END1,       // warpgroup 1 done
  TL_WAITCYC1,   // warpgroup 1's cycles in full-slot waits
  TL_P_WAIT,     // (MOE) the producer's griddepcontrol.wait returned
  TL_P_LAST,     // the producer's last chunk given a slot (its TMA issued)
  TL_P_EMPTYCYC, // the producer's cycles in empty-slot waits
  TL_N
};

__device__ __forceinline__ unsigned long long tl_clock() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
  return t;
}
__device__ __forceinline__ unsigned tl_smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// One thread's stamps, in registers; store() writes the ones it set into the CTA's record. Without
// GEMV_TIMELINE every member is a no-op the compiler removes.
struct Tl {
#if GEMV_TIMELINE
  unsigned long long v[TL_N];
  unsigned set = 0;  // bit f: v[f] holds a value
#endif
  __device__ __forceinline__ void at(int f) {
#if GEMV_TIMELINE
    v[f] = tl_clock(), set |= 1u << f;
#endif
  }
  __device__ __forceinline__ void at_ns(int f) {  // globaltimer into f
#if GEMV_TIMELINE
    v[f] = gemv::global_ns(), set |= 1u << f;
#endif
  }
  __device__ __forceinline__ void put(int f, unsigned long long x) {
#if GEMV_TIMELINE
    v[f] = x, set |= 1u << f;
#endif
  }
  __device__ __forceinline__ void add(int f, unsigned long long x) {
#if GEMV_TIMELINE
    v[f] = (set >> f & 1u ? v[f] : 0ull) + x, set |= 1u << f;
#endif
  }
  // clock64 in the timeline build (the start of a wait that add() then measures), else 0
  __device__ __forceinline__ unsigned long long now() {
#if GEMV_TIMELINE
    return tl_clock();
#else
    return 0ull;
#endif
  }
  __device__ __forceinline__ void store(int seq) {
#if GEMV_TIMELINE
    unsigned long long* tl = gemv_tl;
    if (tl == nullptr || gemv_tl_slots <= 0 || blockIdx.x >= gemv_tl_grid) return;
    unsigned long long* r = tl + ((size_t)(seq % gemv_tl_slots) * gemv_tl_grid + blockIdx.x) * TL_N;
#pragma unroll
    for (int f = 0; f < TL_N; ++f)
      if (set >> f & 1u) r[f] = v[f];
#endif
  }
};

// consumer thread 0's entry stamps and the record's identity
__device__ __forceinline__ void tl_enter(Tl& t, int kind, int n_rows, int seq) {
#if GEMV_TIMELINE
  t.at_ns(TL_GT_IN);
  t.at(TL_IN);
  t.put(TL_META, (unsigned long long)kind | (unsigned long long)gridDim.x << 4 |
                     (unsigned long long)blockIdx.x << 16 | (unsigned long long)tl_smid() << 28 |
                     (unsigned long long)n_rows << 40);
  t.put(TL_SEQ, (unsigned long long)seq + 1);
#endif
}
}  // namespace
