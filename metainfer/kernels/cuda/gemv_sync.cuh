// Part of gemv.cu (one translation unit: gemv.cu includes its parts in order): the watchdog's bounded ring waits.
#pragma once

namespace {
enum : unsigned { WATCH_FULL = 2, WATCH_EMPTY = 3 };
constexpr uint32_t WATCH_LIMIT = 1u << 22;
// Only the first to give up traps, once its report is out: the others (all the CTAs' waits run out within
// microseconds of each other) sleep until that trap ends the grid, so that theirs cannot cut the report short
__device__ __noinline__ void give_up(unsigned code, unsigned saw, unsigned need) {
  if (atomicCAS(&gemv_claim, 0u, 1u) == 0u) {
    if (unsigned* w = gemv_watch) {
      w[1] = blockIdx.x, w[2] = threadIdx.x, w[3] = saw, w[4] = need;
      __threadfence_system();
      w[0] = code;
      __threadfence_system();
    }
    __trap();
  }
  for (;;) __nanosleep(1u << 20);
}
// an mbarrier phase (`mbar_wait`, bounded): a ring slot's (chunk `it` of this CTA); one try inline
__device__ __noinline__ void ring_wait_slow(uint64_t* bar, uint32_t parity, unsigned code, unsigned it) {
  for (uint32_t n = 0; !gemv::bar_try(bar, parity);)
    if (++n == WATCH_LIMIT) give_up(code, it, parity);
}
__device__ __forceinline__ void ring_wait(uint64_t* bar, uint32_t parity, unsigned code, unsigned it) {
  if (!gemv::bar_try(bar, parity)) ring_wait_slow(bar, parity, code, it);
}

}  // namespace
