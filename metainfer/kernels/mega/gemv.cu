// One decode token's FP8 projection on the megakernel's wgmma consumers, as a kernel of its own (KB-0092, KB-0094):
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
// (mega::stage_x8 and mega::wg_dot16: m64n8k32, B = the 4 segments' hi and lo terms). (A K = 4,096 form, m64n16k32
// on 8-row chunks, for the attention o_proj and the DeltaNet out_proj with its gated norm, measured no faster and
// was removed: KB-0095, benchmarks/results/2026-12-04e/k4096_forms_removed.patch.)
// Each 128-column block's product (its own accumulator chain) times the weight and x block scales, summed in fp32.
//
// moe_gate_up_e4m3 (KB-0096): the same K = 2048 kernel over one token's experts' gate/up rows (routed pairs and the
// shared expert, W [E + 1, rows, 2048]): chunk c of the (top_k + 1) rows / 16 is virtual (the shared expert's first,
// then pair 0's, ...). The producer lands the shared expert's chunks before griddepcontrol.wait, then routes (the
// top_k largest router logits, lowest index on ties: routing.softmax_topk's picks), landing each routed chunk as soon
// as its pick is found; the consumers write each row's dot in fp32 (gate and up apart: the down kernel forms
// silu(gate) * up).
//
// gemv_e4m3_pre_gdn (METAINFER_WGMMA_GEMV_GDN): the DeltaNet in_proj (x prologue and conv epilogue as above) with
// the layer's decode step (gdn_decode._gdn_decode_kernel's gated delta rule) in the same launch, one kernel
// boundary fewer a DeltaNet layer. Value head h's step is CTA h's (h < hv <= 32 < grid): each chunk's warpgroup,
// once its rows are stored, adds to count[h] the rows of head h it holds (its key head's q and k, its v, b and a:
// GDN_ROWS in all); CTA h, after its own chunks, waits for the count, then updates its [128, 128] fp32 state
// (prefetched into L2 by its producer at the start, landed in the ring after the CTA's chunks) and writes o. The
// chunks are taken in an order that lands the heads' rows first: from the b/a rows' chunk on (rot), then the rest;
// past `waves` chunks a CTA, only CTAs >= hv take more, so that the updaters start early (gemv.py's gdn_schedule).
//
// moe_gate_up_down_e4m3 (METAINFER_WGMMA_GEMV_MOE_DOWN): moe_gate_up_e4m3 with the experts' down projection after it
// in the same launch, one kernel boundary fewer a layer. The down weights [E + 1, H, I] (I = 512) are chunks of 64
// rows x 512 (the same [64, 512] view and TMA boxes: view row = W row, one segment); each CTA takes a run of them
// (pair by pair, the shared pair first) after its gate/up chunks, so its producer lands them while the gate/up runs.
// Each gate/up chunk adds one to its pair's count; a CTA's consumers wait until the pair's gate/up chunks are all in,
// form silu(gate) * up (bf16, as `_routed_down_kernel`) as x's first 512 columns, and reduce the chunks on wgmma
// (B: x's terms in columns 0, 1): each pair's unweighted fp32 rows, as `moe._routed_down`'s. The last CTA to finish
// zeroes the counts.
#include <cuda.h>  // CUtensorMap

#include "mega_math.cuh"

#ifndef GEMV_PRE_EARLY
#define GEMV_PRE_EARLY 0  // 1: the prologue's residual, norm weight and routing weights before the PDL wait, its rows
                          // in one wave of loads (gemv.py's DEFINES_ENV): neutral on the H200, KB-0102
#endif
#ifndef GEMV_PRE_WAVE
#define GEMV_PRE_WAVE 9  // GEMV_PRE_EARLY's rows in one wave of loads: the model's 8 routed experts and the shared one
#endif
#ifndef GEMV_SLOTS
#define GEMV_SLOTS 4  // ring slots of 32 KB (fewer: room on the SM for the next kernel's CTAs; gemv.py's SLOTS_ENV)
#endif

// The watchdog: every wait on another CTA's count or on the ring is bounded (~2^22 polls, seconds); the first
// thread to give up writes what it waited for into gemv_watch and traps. gemv.py points gemv_watch at pinned host
// memory, which the host can still read once the trap has ended the context (gemv.watchdog_report).
__device__ unsigned* gemv_watch;  // [8]: code (1 a count, 2 a full slot, 3 an empty slot), CTA, thread, what it
                                  // saw (the count; the chunk), what it needed (n; the parity), kernel; or null
__device__ unsigned gemv_claim;   // the first to give up (device memory: no atomics on the host's)

#include "gemv_args.cuh"  // the layout constants and the launches' operands (gemv.py's ctypes mirror them)
#include "gemv_io.cuh"    // the routing, the x prologues, the router's rows, the conv epilogue
#include "gemv_sync.cuh"  // the watchdog's bounded waits, the fused launches' schedules
#include "gemv_gdn.cuh"   // the DeltaNet decode step after the in_proj

namespace {
// One down chunk's 64 dots (DOWN_ROWS rows of K = 512: the view rows are W's rows; B's columns 0, 1 hold x's first
// 512 columns' terms) on the calling warpgroup -> on lanes with lane % 4 == 0 of warp w4: rows 16 w4 + lane / 4 (.x)
// and + 8 (.y); ws: the chunk's 4 block scales
__device__ __forceinline__ float2 wg_dot64(const uint8_t* chunk, const float* ws, const uint8_t* b8, const float* xf) {
  float acc[4][4];
  mega::wg_mma_chunk(chunk, b8, acc);
  float v0 = 0.f, v1 = 0.f;
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    const float f = ws[kb] * xf[kb];
    v0 = fmaf(acc[kb][0] + acc[kb][1], f, v0);
    v1 = fmaf(acc[kb][2] + acc[kb][3], f, v1);
  }
  return make_float2(v0, v1);
}

}  // namespace


template <bool MOE, bool PRE = false, bool GDN = false, bool DOWN = false, bool ROUTER = false, bool W16 = false>
__device__ __forceinline__ void gemv_body(const CUtensorMap* wmap, const float* __restrict__ ws,
                                          const __nv_bfloat16* x, __nv_bfloat16* y, int n_rows, const Conv& conv,
                                          const Pre& pre, const Moe& moe, const Gdn& gdn = Gdn{},
                                          const CUtensorMap* dmap = nullptr, const Down& dn = Down{},
                                          const Next& nx = Next{}, const Router& rt = Router{}) {
  static_assert(!W16 || !(GDN || DOWN || ROUTER), "bf16 weights: the projections and the gate/up (KB-0114)");
  constexpr int RPC = W16 ? 8 : ROWS;  // W's rows a chunk: 8 of bf16, 16 of e4m3 (32 KB either way)
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* ring = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);  // swizzle atoms: 1024-aligned
  float* wsc = reinterpret_cast<float*>(ring + NS * CHUNK);  // [NS][NB] each chunk's block scales
  uint8_t* b8 = reinterpret_cast<uint8_t*>(wsc + NS * NB);   // x's two e4m3 terms (K * 2 bytes)
  float* xf = reinterpret_cast<float*>(b8 + KK * 2);         // [NB] 2^-e per block
  float* xs = xf + NB;                                       // [KK] x (fp32, permuted: mega::xpos)
  float* red = xs + KK;                                      // [NCW] the prologue's block sum
  uint64_t* full = reinterpret_cast<uint64_t*>(red + mega::NCW);
  uint64_t* empty = full + NS;
  uint64_t* rdy = empty + NS;                    // ROUTER: the producer is past its wait on the logits' count
  int* pick = reinterpret_cast<int*>(rdy + 1);  // MOE: the routed experts
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_chunks = n_rows / RPC, grid = gridDim.x;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NS; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 4);  // the chunk's warpgroup
    }
    mbar_init(rdy, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == mega::NCW) {  // producer: no wait (static bytes only), except for MOE's routing
    // chunk it of this CTA into its slot: the map's view rows v64 .. v64 + 63 and their block scales
    auto land_at = [&](uint32_t it, const CUtensorMap* map, int v64, const float* sc, uint32_t sbytes) {
      const uint32_t slot = it % NS;
      ring_wait(&empty[slot], ((it / NS) & 1) ^ 1, WATCH_EMPTY, it);
      mbar_expect_tx(&full[slot], CHUNK + sbytes);
      for (int kb = 0; kb < SEG / 128; ++kb) tma_2d(ring + slot * CHUNK + kb * 8192, map, kb * 128, v64, &full[slot]);
      if (sbytes) bulk_load(wsc + slot * NB, sc, sbytes, &full[slot]);
    };
    // W's chunk g (its rows g * ROWS..)
    auto land = [&](uint32_t it, int g) {  // (bf16: no block scales)
      if constexpr (W16) land_at(it, wmap, g * 64, nullptr, 0);
      else land_at(it, wmap, g * 64, ws + (size_t)(g * ROWS / 128) * NB, NB * 4);
    };
    int c = blockIdx.x;
    uint32_t it = 0;
    if constexpr (MOE) {
      const int cpp = moe.rows / RPC;  // chunks a pair; virtual chunk c: pair q - 1 of c / cpp (q = 0: shared)
      for (; c < cpp; c += grid, ++it)  // the shared expert's: static
        if (lane == 0) land(it, moe.E * cpp + c);
      asm volatile("griddepcontrol.wait;" ::: "memory");  // the router's logits (ROUTER: the count's last reset)
      if constexpr (ROUTER) {  // the logits are this launch's consumers': all E + 1 stored
        if (lane == 0) {
          wait_at_least(rt.count, moe.E + 1, 3);
          mbar_arrive(rdy);
        }
        __syncwarp();
      }
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
      if constexpr (DOWN) {  // this CTA's run of down chunks: down chunk d of virtual pair d / dpp
        int lo, hi;
        down_run(blockIdx.x, grid, (moe.top_k + 1) * dn.dpp, lo, hi);
        for (int d = lo; d < hi; ++d, ++it) {
          const int q = d / dn.dpp;
          for (; known < q; ++known) {
            const int e = route_next(r, lane);
            if (lane == 0) pick[known] = e;
          }
          const int gd = (q == 0 ? moe.E : pick[q - 1]) * dn.dpp + d % dn.dpp;  // in the [(E + 1) H, 512] view
          if (lane == 0) land_at(it, dmap, gd * DOWN_ROWS, dn.ws + (size_t)(gd * DOWN_ROWS / 128) * (SEG / 128), 16);
        }
      }
      if (lane == 0 && nx.w != nullptr && blockIdx.x < nx.grid)  // every landing issued: the next projection's
        for (int k = 0, c = blockIdx.x; k < nx.k && c < nx.n; ++k, c += nx.grid)  // first chunks into L2
          l2_prefetch(nx.w + (size_t)((c + nx.rot) % nx.n) * CHUNK, CHUNK);
      if (blockIdx.x == 0) {
        for (; known < moe.top_k; ++known) {
          const int e = route_next(r, lane);
          if (lane == 0) pick[known] = e;
        }
        __syncwarp();
        route_weights(moe, pick, lane);
      }
    } else if (lane == 0) {
      if (GDN) gdn_prefetch(gdn);
      int k = 0;
      for (; (c = chunk_at<GDN>(k, n_chunks, gdn)) >= 0; ++k) land(k, GDN ? (c + gdn.rot) % n_chunks : c);
      if (GDN && blockIdx.x < gdn.hv) {  // CTA h: its head's state, rows 0-63 and 64-127, as chunks k and k + 1
        asm volatile("griddepcontrol.wait;" ::: "memory");  // (the slot is a step input: final after the wait)
        const float* S = gdn.state + ((size_t)gdn.slots[0] * gdn.hv + blockIdx.x) * GDN_D * GDN_D;
        for (int j = 0; j < 2; ++j, ++k) {
          const uint32_t sl = k % NS;
          ring_wait(&empty[sl], ((k / NS) & 1) ^ 1, WATCH_EMPTY, k);
          mbar_expect_tx(&full[sl], CHUNK);
          bulk_load(ring + sl * CHUNK, S + j * (CHUNK / 4), CHUNK, &full[sl]);
        }
      }
    }
    return;
  }
  PreEarly early;
  if constexpr (PRE && GEMV_PRE_EARLY) early = pre_early(pre);  // none of it written by the previous kernel
  const int rr = blockIdx.x + warp * grid;  // ROUTER: this warp's router row (one at most: gemv.py checks)
  RouterRow rrow;
  if (ROUTER && rr <= moe.E) router_row_load(rt, rr, lane, rrow);  // weights: before the wait
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
  if (threadIdx.x == 0) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  static_assert(KK % (8 * mega::CT) == 0, "whole 16-byte loads of x per consumer thread");
  constexpr int NV = KK / (8 * mega::CT);
  if (PRE) {
    stage_pre(pre, early, xs, red, warp, lane);
  } else if (ROUTER) {
    stage_router(rt, xs, red, warp, lane);
  } else {
    uint4 xv[NV];  // x: 16-byte loads of 8 bf16, all in flight, then fp32 into xs at xpos
#pragma unroll
    for (int j = 0; j < NV; ++j) xv[j] = __ldcg(reinterpret_cast<const uint4*>(x) + threadIdx.x + j * mega::CT);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const uint32_t w[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int e = (threadIdx.x + j * mega::CT) * 8 + 2 * i;
        xs[mega::xpos(e)] = __uint_as_float(w[i] << 16);
        xs[mega::xpos(e + 1)] = __uint_as_float(w[i] & 0xffff0000u);
      }
    }
  }
  consumers_sync(mega::CT);
  if (ROUTER && rr <= moe.E) router_row_dot(rt, moe, rr, lane, rrow, xs);
  if constexpr (W16) mega::stage_xb16(xs, b8, threadIdx.x);
  else mega::stage_x8(xs, b8, xf, warp, lane);
  consumers_sync(mega::CT);
  const int wg = warp / 4, w4 = warp & 3;
  const long long slot = conv.n_conv ? conv.slots[0] : 0;  // (after the wait: the step's inputs)
  const bool has = conv.n_conv && conv.has[0] != 0;
  for (int it = wg, c; (c = chunk_at<GDN>(it, n_chunks, gdn)) >= 0; it += 2) {
    const uint32_t slot_i = it % NS;
    const int p = GDN ? (c + gdn.rot) % n_chunks : c;  // W's chunk (MOE: c, virtual)
    // e4m3: lanes 0-3 store the warp's 4 rows; bf16: lanes 0-1 its 2
    const int row = W16 ? p * 8 + 2 * w4 + (lane & 1) : p * 16 + 4 * w4 + (lane & 3);
    const bool is_conv = lane < (W16 ? 2 : 4) && row < conv.n_conv;
    ConvRow cr;
    if (is_conv) cr = conv_loads(row, conv, slot, has);
    ring_wait(&full[slot_i], (it / NS) & 1, WATCH_FULL, it);
    if constexpr (W16) {  // rows 2 w4 (.x) and 2 w4 + 1 (.y) on every lane
      const float2 v = mega::wg_dot8_bf16(ring + slot_i * CHUNK, b8, lane);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot_i]);
      if (MOE && lane < 2) {  // pair q - 1's row (q = 0: the shared pair, top_k)
        const int cpp = moe.rows / RPC, q = c / cpp;
        const int pair = q == 0 ? moe.top_k : q - 1;
        moe.gu[(size_t)pair * moe.rows + (c - q * cpp) * RPC + 2 * w4 + lane] = lane ? v.y : v.x;
      } else if (lane < 2) {
        const __nv_bfloat16 yb = __float2bfloat16_rn(lane ? v.y : v.x);
        y[row] = is_conv ? conv_row(yb, row, cr, conv, slot) : yb;
      }
      continue;
    }
    const float2 v = mega::wg_dot16(ring + slot_i * CHUNK, wsc + slot_i * NB, b8, xf, lane);
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
    if (DOWN || (GDN && gdn_awaited(gdn, p * ROWS))) {  // the chunk's 16 outputs are stored (lanes 0-3 of each
      // warp): count them where awaited (p is the warpgroup's: the barrier is taken by all of it or none)
      if (lane < 4) __threadfence();
      warpgroup_sync(wg);
      if (GDN && w4 == 0) gdn_arrive(gdn, p * ROWS, lane);  // for the heads that read these rows
      if (DOWN && w4 == 0 && lane == 0) {  // one more of its pair's: the fence after the barrier, so that it
        __threadfence();                     // orders the other warps' stores too (the PTX model's cumulativity)
        atomicAdd(dn.count + c / (moe.rows / ROWS), 1u);
      }
    }
  }
  if (GDN && blockIdx.x < gdn.hv) {  // the state's two pieces follow the CTA's chunks in the ring
    const int k0 = imin(gdn.waves, chunks_of(blockIdx.x, grid, n_chunks));
    gdn_update(gdn, y, xs, reinterpret_cast<const float*>(ring + (k0 % NS) * CHUNK),
               reinterpret_cast<const float*>(ring + ((k0 + 1) % NS) * CHUNK), &full[k0 % NS],
               &full[(k0 + 1) % NS], k0, warp, lane);
  }
  if constexpr (DOWN) {
    const int cpp = moe.rows / ROWS, I = moe.rows / 2, H = dn.dpp * DOWN_ROWS;
    int lo, hi;
    down_run(blockIdx.x, grid, (moe.top_k + 1) * dn.dpp, lo, hi);
    const int first = chunks_of(blockIdx.x, grid, n_chunks);  // this CTA's gate/up chunks: it 0 .. first - 1
    for (int d = lo; d < hi;) {  // one pair's part of the run at a time
      const int q = d / dn.dpp, end = min(hi, (q + 1) * dn.dpp), pair = q == 0 ? moe.top_k : q - 1;
      consumers_sync(mega::CT);  // the chunks before are done with x's terms
      if (threadIdx.x == 0) wait_at_least(dn.count + q, cpp, 2);
      consumers_sync(mega::CT);
      const float* gu = moe.gu + (size_t)pair * moe.rows;
      for (int i = threadIdx.x; i < I; i += mega::CT) {  // silu(gate) * up, rounded to bf16 (the kernel's x dtype)
        const float gv = __ldcg(gu + i), uv = __ldcg(gu + I + i);
        xs[mega::xpos(i)] = __bfloat162float(__float2bfloat16_rn(gv * (1.f / (1.f + expf(-gv))) * uv));
      }
      consumers_sync(mega::CT);
      mega::stage_x8(xs, b8, xf, warp, lane, I / 128);
      consumers_sync(mega::CT);
      for (int it = first + (d - lo); d < end; ++d, ++it) {
        if ((it & 1) != wg) continue;
        const uint32_t slot_i = it % NS;
        ring_wait(&full[slot_i], (it / NS) & 1, WATCH_FULL, it);
        const float2 v = wg_dot64(ring + slot_i * CHUNK, wsc + slot_i * NB, b8, xf);
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot_i]);
        if ((lane & 3) == 0) {
          float* o = dn.out + (size_t)pair * H + (d % dn.dpp) * DOWN_ROWS + 16 * w4 + (lane >> 2);
          o[0] = v.x;
          o[8] = v.y;
        }
      }
    }
    consumers_sync(mega::CT);  // every read of this CTA's counts is done
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(dn.count + MOE_MAX_K, 1u) == gridDim.x - 1) {  // the last CTA: no count is read any more
        __threadfence();  // (acquire: every CTA's increments are before the zeroes)
        for (int q = 0; q <= moe.top_k; ++q) dn.count[q] = 0u;
        dn.count[MOE_MAX_K] = 0u;
      }
    }
  }
  if constexpr (ROUTER) {  // the logits' count: zeroed by the last CTA once every CTA's producer is past its wait
    if (threadIdx.x == 0) {
      ring_wait(rdy, 0, WATCH_READY, 0, 3);
      __threadfence();
      if (atomicAdd(rt.count + 1, 1u) == gridDim.x - 1) {
        __threadfence();
        rt.count[0] = 0u;
        rt.count[1] = 0u;
      }
    }
  }
}

// K = 2048 (with the conv epilogue where conv.n_conv > 0)
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    gemv_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws, const __nv_bfloat16* x,
              __nv_bfloat16* y, int n_rows, const Conv conv) {
  gemv_body<false>(&wmap, ws, x, y, n_rows, conv, Pre{}, Moe{});
}

// the same with x from the prologue (Pre: the previous MoE's sum, the residual add and the input norm)
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    gemv_e4m3_pre(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws, __nv_bfloat16* y,
                  int n_rows, const Conv conv, const Pre pre) {
  gemv_body<false, true>(&wmap, ws, nullptr, y, n_rows, conv, pre, Moe{});
}

// gemv_e4m3_pre of bf16 weights (KB-0114; W [N, 2048] bf16, N a multiple of 8, no scales): the BF16 model's qkv /
// in_proj with the input norm as the x prologue and the decode conv as the epilogue
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    gemv_bf16_pre(const __grid_constant__ CUtensorMap wmap, __nv_bfloat16* y, int n_rows, const Conv conv,
                  const Pre pre) {
  gemv_body<false, true, false, false, false, true>(&wmap, nullptr, nullptr, y, n_rows, conv, pre, Moe{});
}

// gemv_e4m3_pre with the DeltaNet decode step after it (Gdn: see the header)
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    gemv_e4m3_pre_gdn(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws, __nv_bfloat16* y,
                      int n_rows, const Conv conv, const Pre pre, const Gdn gdn) {
  gemv_body<false, true, true>(&wmap, ws, nullptr, y, n_rows, conv, pre, Moe{}, gdn);
}

// one token's experts' gate/up (x: the normed hidden state), routed here from moe.logits (see the header)
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    moe_gate_up_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws,
                     const __nv_bfloat16* x, const Moe moe, const Next nx) {
  gemv_body<true>(&wmap, ws, x, nullptr, (moe.top_k + 1) * moe.rows, Conv{}, Pre{}, moe, Gdn{}, nullptr, Down{}, nx);
}

// moe_gate_up_e4m3 of bf16 weights (KB-0114; w [E + 1, rows, 2048] bf16, 8 rows a chunk, no scales): the BF16
// model's experts' gate/up, routed in the producer as the e4m3 form is
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    moe_gate_up_bf16(const __grid_constant__ CUtensorMap wmap, const __nv_bfloat16* x, const Moe moe,
                     const Next nx) {
  gemv_body<true, false, false, false, false, true>(&wmap, nullptr, x, nullptr, (moe.top_k + 1) * moe.rows, Conv{},
                                                    Pre{}, moe, Gdn{}, nullptr, Down{}, nx);
}

// moe_gate_up_e4m3 with the experts' down projection after it (Down: see the header)
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    moe_gate_up_down_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws,
                          const __nv_bfloat16* x, const Moe moe, const __grid_constant__ CUtensorMap dmap,
                          const Down dn, const Next nx) {
  gemv_body<true, false, false, true>(&wmap, ws, x, nullptr, (moe.top_k + 1) * moe.rows, Conv{}, Pre{}, moe, Gdn{},
                                      &dmap, dn, nx);
}

// moe_gate_up_down_e4m3 with the post-mixer add, RMSNorm and router in the same launch (Router: see its struct;
// moe.logits is where the logits go, x is the consumers' own). Only with the down: the Triton down after
// moe_gate_up_e4m3 reads the logits before its PDL wait, which this launch would write just before it.
extern "C" __global__ void __launch_bounds__(mega::NT, 1)
    moe_router_gate_up_down_e4m3(const __grid_constant__ CUtensorMap wmap, const float* __restrict__ ws,
                                 const Moe moe, const __grid_constant__ CUtensorMap dmap, const Down dn,
                                 const Next nx, const Router rt) {
  gemv_body<true, false, false, true, true>(&wmap, ws, nullptr, nullptr, (moe.top_k + 1) * moe.rows, Conv{}, Pre{},
                                            moe, Gdn{}, &dmap, dn, nx, rt);
}

// the watchdog's report buffer (gemv.py: pinned host memory, once at load)
extern "C" __global__ void gemv_set_watch(unsigned* w) { gemv_watch = w; }

// the layout constants the launcher (gemv.py) must agree with
extern "C" __global__ void gemv_constants(long long* out) {
  out[0] = mega::NT;
  out[1] = static_cast<long long>(SMEM);
  out[2] = static_cast<long long>(sizeof(Conv)) * 100 + CONV_K;
  out[3] = static_cast<long long>(sizeof(Moe)) * 10000 + MOE_MAX_E * 100 + MOE_MAX_K;
  out[4] = static_cast<long long>(sizeof(Pre)) * 100 + PRE_MAX_W;
  out[5] = static_cast<long long>(sizeof(Gdn)) * 100000 + GDN_D * 1000 + GDN_ROWS;
  out[6] = static_cast<long long>(sizeof(Down)) * 1000 + DOWN_ROWS;
  out[7] = static_cast<long long>(sizeof(Next));
  out[8] = static_cast<long long>(sizeof(Router));
}
