// Part of gemv.cu (one translation unit: gemv.cu includes its parts in order): the watchdog's bounded waits and
// the fused launches' schedules.
#pragma once

namespace {
enum : unsigned { WATCH_COUNT = 1, WATCH_FULL = 2, WATCH_EMPTY = 3, WATCH_READY = 4 };
constexpr uint32_t WATCH_LIMIT = 1u << 22;
// Only the first to give up traps, once its report is out: the others (all the CTAs' waits run out within
// microseconds of each other) sleep until that trap ends the grid, so that theirs cannot cut the report short
__device__ __noinline__ void give_up(unsigned code, unsigned saw, unsigned need, unsigned kernel) {
  if (atomicCAS(&gemv_claim, 0u, 1u) == 0u) {
    if (unsigned* w = gemv_watch) {
      w[1] = blockIdx.x, w[2] = threadIdx.x, w[3] = saw, w[4] = need, w[5] = kernel;
      __threadfence_system();
      w[0] = code;
      __threadfence_system();
    }
    __trap();
  }
  for (;;) __nanosleep(1u << 20);
}
// a count in global memory reaching n (one thread): bounded, so that a count that never comes traps (and says so)
// instead of hanging the step; kernel: which launch (gemv.py's WATCH_KERNELS)
// (relaxed polls, then a fence: the acquire; an ld.acquire each poll would invalidate the SM's L1 each time)
__device__ __forceinline__ void wait_at_least(const unsigned* p, unsigned n, unsigned kernel) {
  uint32_t i = 0;
  for (unsigned v; (v = ld_relaxed_u32(p)) < n;)
    if (++i == WATCH_LIMIT) give_up(WATCH_COUNT, v, n, kernel);
    else __nanosleep(32);
  __threadfence();
}
// an mbarrier phase (`mbar_wait`, bounded): a ring slot's (chunk `it` of this CTA), or ROUTER's producer-ready
// (kernel 3); one try inline
__device__ __noinline__ void ring_wait_slow(uint64_t* bar, uint32_t parity, unsigned code, unsigned it,
                                            unsigned kernel) {
  for (uint32_t n = 0; !mega::bar_try(bar, parity);)
    if (++n == WATCH_LIMIT) give_up(code, it, parity, kernel);
}
__device__ __forceinline__ void ring_wait(uint64_t* bar, uint32_t parity, unsigned code, unsigned it,
                                          unsigned kernel = 0) {
  if (!mega::bar_try(bar, parity)) ring_wait_slow(bar, parity, code, it, kernel);
}

// ---- the fused launches' schedules: host-callable, so tests/kernels/gemv_schedule_check.cu runs these very
// functions on the CPU ----
__host__ __device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
// the virtual index of CTA b's k-th chunk (of n, over grid CTAs), or -1: chunk b + k grid; with hv > 0 (GDN) that
// for k < waves only, past them the chunks left go to the CTAs >= hv alone
__host__ __device__ __forceinline__ int chunk_of(int b, int k, int grid, int n, int hv, int waves) {
  int c = b + k * grid;
  if (hv > 0 && k >= waves) {
    if (b < hv) return -1;
    c = waves * grid + (b - hv) + (k - waves) * (grid - hv);
  }
  return c < n ? c : -1;
}
// the chunks b + k grid < n: CTA b's count without GDN's rule
__host__ __device__ __forceinline__ int chunks_of(int b, int grid, int n) { return (n - b + grid - 1) / grid; }
// of y's rows r0 .. r0 + ROWS - 1, those value head h's step reads: its key head's q and k, its v, b and a
__host__ __device__ __forceinline__ int gdn_rows(const Gdn& g, int r0, int h) {
  const int kh = h / (g.hv / g.hk);
  const int at[5] = {kh * GDN_D, (g.hk + kh) * GDN_D, (2 * g.hk + h) * GDN_D, g.b_off + h, g.a_off + h};
  const int len[5] = {GDN_D, GDN_D, GDN_D, 1, 1};
  int n = 0;
  for (int i = 0; i < 5; ++i) n += imax(0, imin(at[i] + len[i], r0 + ROWS) - imax(at[i], r0));
  return n;
}
// whether any head's step reads one of rows r0 .. r0 + ROWS - 1 (q, k, v below (2 hk + hv) D; b; a): the z rows'
// chunks are counted by no one, so their warpgroups skip the fence and barrier
__host__ __device__ __forceinline__ bool gdn_awaited(const Gdn& g, int r0) {
  const int r1 = r0 + ROWS;
  return r0 < (2 * g.hk + g.hv) * GDN_D || (r0 < g.b_off + g.hv && g.b_off < r1) ||
         (r0 < g.a_off + g.hv && g.a_off < r1);
}
// CTA b's run of down chunks [lo, hi) of n_dn (moe_gate_up_down_e4m3: after its chunks_of(b, grid, gate/up) ones)
__host__ __device__ __forceinline__ void down_run(int b, int grid, int n_dn, int& lo, int& hi) {
  lo = b * n_dn / grid;
  hi = (b + 1) * n_dn / grid;
}
}  // namespace
