// One decode token's FP8 projection on wgmma, a kernel of its own:
//   y[n] = bf16( sum_b scale[n / 128][b] * (W[n, 128 b : 128 b + 128] . x[128 b : 128 b + 128]) ),
// W [N, K] e4m3 with K = 2048 (N a multiple of 16), scale [ceil(N / 128), K / 128] fp32, x [K] bf16, y [N] bf16.
//
// One CTA per SM (grid <= the chunks). A chunk is 32 KB of W: 16 rows, the [64, 512] view of W's rows as
// [N * 4, 512] (row r's 512-byte segment s at view row 4 r + s). Warp 8 lands the
// CTA's chunks (chunk c on CTA c % grid) by TMA (boxes of 64 rows, 128-byte swizzle: launch.encode_tensor_map(w,
// 512, 64)) into a ring of GEMV_SLOTS x 32 KB, each with its K / 128 block scales on the same mbarrier. It starts
// before griddepcontrol.wait: weights and scales are never written during a step, so they stream while the previous
// kernel runs (programmatic dependent launch; metainfer/kernels/pdl.py's contract). Warps 0-7 (two warpgroups,
// alternate chunks) wait for the previous kernel, release the next one, read x, split it into two e4m3 terms per
// 128-column block (exact for bf16 down to 2^-9 of the block's largest) and reduce each chunk on wgmma
// (gemv::stage_x8 and gemv::wg_dot16: m64n8k32, B = the 4 segments' hi and lo terms).
// Each 128-column block's product (its own accumulator chain) times the weight and x block scales, summed in fp32.
//
// moe_gate_up_e4m3: the same K = 2048 kernel over one token's experts' gate/up rows (routed pairs and the
// shared expert, W [E + 1, rows, 2048]): chunk c of the (top_k + 1) rows / 16 is virtual (the shared expert's first,
// then pair 0's, ...). The producer lands the shared expert's chunks before griddepcontrol.wait, then routes (the
// top_k largest router logits, lowest index on ties: routing.softmax_topk's picks), landing each routed chunk as soon
// as its pick is found; the consumers write each row's dot in fp32 (gate and up apart: the down kernel forms
// silu(gate) * up).
//
// The timeline build (-DGEMV_TIMELINE=1: gemv.use_timeline_build; gemv_timeline.cuh, gemv_timeline.py) records each
// CTA's phases (entry, the wait, the prologue, x staged, the first chunk, the end) in SM cycles and globaltimer; every
// launch takes its sequence number (seq) for the record's place. The default build's code is unchanged by it.
#include <cuda.h>  // CUtensorMap

#include "gemv_math.cuh"  // the warps, the reductions, x's layout, the wgmma dot

#define GEMV_SLOTS 4  // ring slots of 32 KB, even (gemv_args.cuh); few enough for the next kernel's CTAs beside it

// The watchdog: every wait on the ring is bounded (~2^22 polls, seconds); the first thread to give up writes what
// it waited for into gemv_watch and traps. gemv.py points gemv_watch at pinned host
// memory, which the host can still read once the trap has ended the context (gemv.watchdog_report).
__device__ unsigned* gemv_watch;  // [8]: code (2 a full slot, 3 an empty slot), CTA, thread, the chunk, the
                                  // parity; or null
__device__ unsigned gemv_claim;   // the first to give up (device memory: no atomics on the host's)

#include "gemv_args.cuh"  // the layout constants and the launches' operands (gemv.py's ctypes mirror them)
#include "gemv_timeline.cuh"  // the timeline build's per-CTA stamps (-DGEMV_TIMELINE=1)
#include "gemv_io.cuh"        // the routing, the x prologue, the conv epilogue
#include "gemv_sync.cuh"      // the watchdog's bounded ring waits

template <bool MOE, bool PRE = false>
__device__ __forceinline__ void gemv_body(const CUtensorMap* wmap, const float* __restrict__ ws,
                                          const __nv_bfloat16* x, __nv_bfloat16* y, int n_rows, const Conv& conv,
                                          const Pre& pre, const Moe& moe, int seq) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* ring = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);  // swizzle atoms: 1024-aligned
  float* wsc = reinterpret_cast<float*>(ring + NS * CHUNK);  // [NS][NB] each chunk's block scales
  uint8_t* b8 = reinterpret_cast<uint8_t*>(wsc + NS * NB);   // x's two e4m3 terms (K * 2 bytes)
  float* xf = reinterpret_cast<float*>(b8 + KK * 2);         // [NB] 2^-e per block
  float* xs = xf + NB;                                       // [KK] x (fp32, permuted: gemv::xpos)
  float* red = xs + KK;                                      // [NCW] the prologue's block sum
  uint64_t* full = reinterpret_cast<uint64_t*>(red + gemv::NCW);
  uint64_t* empty = full + NS;
  int* pick = reinterpret_cast<int*>(empty + NS);  // MOE: the routed experts
  Tl tl;  // (the timeline build's stamps)
  if (threadIdx.x == 0) tl_enter(tl, MOE ? 2 : PRE ? 1 : 0, n_rows, seq);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_chunks = n_rows / ROWS, grid = gridDim.x;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NS; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 4);  // the chunk's warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == gemv::NCW) {  // producer: no wait (static bytes only), except for MOE's routing
    // chunk it of this CTA into its slot: W's chunk g (its rows g * ROWS..) and their block scales
    auto land = [&](uint32_t it, int g) {
      const uint32_t slot = it % NS;
      const unsigned long long t0 = tl.now();
      ring_wait(&empty[slot], ((it / NS) & 1) ^ 1, WATCH_EMPTY, it);
      tl.add(TL_P_EMPTYCYC, tl.now() - t0);
      mbar_expect_tx(&full[slot], CHUNK + NB * 4);
      for (int kb = 0; kb < SEG / 128; ++kb)
        tma_2d(ring + slot * CHUNK + kb * 8192, wmap, kb * 128, g * 64, &full[slot]);
      bulk_load(wsc + slot * NB, ws + (size_t)(g * ROWS / 128) * NB, NB * 4, &full[slot]);
    };
    int c = blockIdx.x;
    uint32_t it = 0;
    if constexpr (MOE) {
      const int cpp = moe.rows / ROWS;  // chunks a pair; virtual chunk c: pair q - 1 of c / cpp (q = 0: shared)
      for (; c < cpp; c += grid, ++it)  // the shared expert's: static
        if (lane == 0) land(it, moe.E * cpp + c);
      asm volatile("griddepcontrol.wait;" ::: "memory");  // the router's logits
      tl.at(TL_P_WAIT);
      Route r;
      route_load(moe, r, lane);
      int known = 0;  // picks found
      for (; c < n_chunks; c += grid, ++it) {
        const int q = c / cpp;
        for (; known < q; ++known) {  // (warp-uniform)
          const int e = route_next(r, lane);
          if (lane == 0) pick[known] = e;
        }
        if (lane == 0) land(it, pick[q - 1] * cpp + c - q * cpp);
      }
      if (blockIdx.x == 0) {
        for (; known < moe.top_k; ++known) {
          const int e = route_next(r, lane);
          if (lane == 0) pick[known] = e;
        }
        __syncwarp();
        route_weights(moe, pick, lane);
      }
    } else if (lane == 0) {
      for (; c < n_chunks; c += grid, ++it) land(it, c);
    }
    if (lane == 0) {
      tl.at(TL_P_LAST);
      tl.store(seq);
    }
    return;
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
  if (threadIdx.x == 0) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (threadIdx.x == 0) tl.at(TL_WAIT);
  static_assert(KK % (8 * gemv::CT) == 0, "whole 16-byte loads of x per consumer thread");
  constexpr int NV = KK / (8 * gemv::CT);
  if (PRE) {
    stage_pre(pre, xs, red, warp, lane, tl);
  } else {
    uint4 xv[NV];  // x: 16-byte loads of 8 bf16, all in flight, then fp32 into xs at xpos
#pragma unroll
    for (int j = 0; j < NV; ++j) xv[j] = __ldcg(reinterpret_cast<const uint4*>(x) + threadIdx.x + j * gemv::CT);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const uint32_t w[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int e = (threadIdx.x + j * gemv::CT) * 8 + 2 * i;
        xs[gemv::xpos(e)] = __uint_as_float(w[i] << 16);
        xs[gemv::xpos(e + 1)] = __uint_as_float(w[i] & 0xffff0000u);
      }
    }
  }
  consumers_sync(gemv::CT);
  if (threadIdx.x == 0) tl.at(TL_STAGED);
  gemv::stage_x8(xs, b8, xf, warp, lane);
  consumers_sync(gemv::CT);
  if (threadIdx.x == 0) tl.at(TL_X);
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
    const unsigned long long t0 = tl.now();
    ring_wait(&full[slot_i], (it / NS) & 1, WATCH_FULL, it);
    if (threadIdx.x % 128 == 0) {  // the warpgroup's first thread: its wait, its first chunk's arrival
      const unsigned long long t1 = tl.now();  // (constant fields in each branch: the stamps stay in registers)
      if (wg == 0) {
        tl.add(TL_WAITCYC0, t1 - t0);
        if (it == 0) tl.put(TL_FIRST, t1);
      } else {
        tl.add(TL_WAITCYC1, t1 - t0);
        if (it == 1) tl.put(TL_FIRST1, t1);
      }
    }
    const float2 v = gemv::wg_dot16(ring + slot_i * CHUNK, wsc + slot_i * NB, b8, xf, lane);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot_i]);
    // wg_dot16: rows 4 w4 + {0, 1} (.x on lanes 0, 16) and 4 w4 + {2, 3} (.y on lanes 0, 16)
    const float r01 = __shfl_sync(0xffffffffu, v.x, (lane & 1) * 16);
    const float r23 = __shfl_sync(0xffffffffu, v.y, (lane & 1) * 16);
    if (MOE && lane < 4) {  // pair q - 1's row (q = 0: the shared pair, top_k)
      const int cpp = moe.rows / ROWS, q = c / cpp;
      const int pair = q == 0 ? moe.top_k : q - 1;
      moe.gu[(size_t)pair * moe.rows + (c - q * cpp) * ROWS + 4 * w4 + lane] = lane < 2 ? r01 : r23;
    } else if (lane < 4) {
      const __nv_bfloat16 yb = __float2bfloat16_rn(lane < 2 ? r01 : r23);
      y[row] = is_conv ? conv_row(yb, row, cr, conv, slot) : yb;
    }
  }
  if (threadIdx.x % 128 == 0) {
    if (wg == 0) {
      tl.at(TL_END0);
      tl.at_ns(TL_GT_END0);
    } else {
      tl.at(TL_END1);
    }
    tl.store(seq);
  }
}

// K = 2048 (with the conv epilogue where conv.n_conv > 0)
extern "C" __global__ void __launch_bounds__(gemv::NT, 1)
    gemv_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws, const __nv_bfloat16* x,
              __nv_bfloat16* y, int n_rows, const Conv conv, int seq) {
  gemv_body<false>(&wmap, ws, x, y, n_rows, conv, Pre{}, Moe{}, seq);
}

// the same with x from the prologue (Pre: the previous MoE's sum, the residual add and the input norm)
extern "C" __global__ void __launch_bounds__(gemv::NT, 1)
    gemv_e4m3_pre(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws, __nv_bfloat16* y,
                  int n_rows, const Conv conv, const Pre pre, int seq) {
  gemv_body<false, true>(&wmap, ws, nullptr, y, n_rows, conv, pre, Moe{}, seq);
}

// one token's experts' gate/up (x: the normed hidden state), routed here from moe.logits (see the header)
extern "C" __global__ void __launch_bounds__(gemv::NT, 1)
    moe_gate_up_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws,
                     const __nv_bfloat16* x, const Moe moe, int seq) {
  gemv_body<true>(&wmap, ws, x, nullptr, (moe.top_k + 1) * moe.rows, Conv{}, Pre{}, moe, seq);
}

// the watchdog's report buffer (gemv.py: pinned host memory, once at load)
extern "C" __global__ void gemv_set_watch(unsigned* w) { gemv_watch = w; }

// the timeline build's records (gemv_timeline.py): [slots][grid][TL_N] words, or null (off)
extern "C" __global__ void gemv_set_timeline(unsigned long long* buf, int slots, int grid) {
  gemv_tl = buf, gemv_tl_slots = slots, gemv_tl_grid = grid;
}

// the layout constants the launcher (gemv.py) must agree with
extern "C" __global__ void gemv_constants(long long* out) {  // [6]
  out[0] = gemv::NT;
  out[1] = static_cast<long long>(SMEM);
  out[2] = static_cast<long long>(sizeof(Conv)) * 100 + CONV_K;
  out[3] = static_cast<long long>(sizeof(Moe)) * 10000 + MOE_MAX_E * 100 + MOE_MAX_K;
  out[4] = static_cast<long long>(sizeof(Pre)) * 100 + PRE_MAX_W;
  out[5] = GEMV_TIMELINE * 100 + TL_N;
}
