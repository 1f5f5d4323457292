// The megakernel's arithmetic: the x prologues (norms), the CUDA-core and tensor-core dots, the routing.
// Written as a part of the persistent megakernel (mega.cu: removed, its code at commit b4eb65f); gemv.cu includes it
// (the parts only the megakernel used are still here).
#pragma once

#include "mega_base.cuh"

namespace mega {
// ---- the x prologues ------------------------------------------------------------------------------
constexpr int MAX_PAIRS = 8;  // pairs of x per consumer thread: K <= 4096 (program.py)

// RMSNorm of v[e] = x(e) (+ add(e), rounded to bf16) into xs: bf16(v / rms(v) * (1 + w)). A thread's norm
// weights (its pairs' bf16 pairs) are loaded while x is polled; the scaling pass reads back only what the
// thread staged, in registers' reach (no per-element index math: its pairs sit 512 floats apart in xs).
__device__ void stage_norm(const XIn& x, const Source* add, const __nv_bfloat16* nw, float eps, int K, uint32_t tag,
                           const Smem& s, int ct, int cw, int lane) {
  const int m = K / (2 * CT);
  uint32_t w2[MAX_PAIRS];
#pragma unroll
  for (int j = 0; j < MAX_PAIRS; ++j)
    if (j < m) w2[j] = *reinterpret_cast<const uint32_t*>(nw + 2 * (ct + j * CT));
  const float ss = stage_raw<NORM_GROUP>(x, add, K, s.xs, tag, ct);
  prof_mark(ct, PF_S1);
  const float r = rsqrtf(block_sum(ss, s.sc, cw, lane) / K + eps);
  prof_mark(ct, PF_S2);
  float2* xp = reinterpret_cast<float2*>(s.xs + xpos(2 * ct));  // pair j at xp[256 j] (xpos: + 512 j)
#pragma unroll
  for (int j = 0; j < MAX_PAIRS; ++j)
    if (j < m) {
      const float2 w = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w2[j]));
      const float2 v = xp[256 * j];
      xp[256 * j] = make_float2(bf(v.x * r * (1.f + w.x)), bf(v.y * r * (1.f + w.y)));
    }
  prof_mark(ct, PF_S4);
}

// The DeltaNet gated RMSNorm per head of hd values (reference.gated_rms_norm) of x (the core output) with z.
// Warp cw holds elements [cw K / NCW, (cw + 1) K / NCW), whole heads (program.py: hd divides K / NCW), as the
// pairs q0 + 32 j (j < m = K / 512): a head is wph = hd / 64 consecutive j, its sum of squares a sum of warp
// sums in the warp's own scratch row, so no block barrier. First the thread's norm weights (wph pairs, the same
// places in every head); then, GATED_GROUP pairs at a time, z's loads and x's (the core outputs, polled) all in
// flight: silu(z) into xs at x's places (z is ready: in_proj's), x's bf16 pairs into scratch once settled,
// each pair's sum of squares into the row. Then the norm from registers and shared memory alone. hd: 64 or 128
// (program.py).
__device__ void stage_gated(const XIn& x, const Source& z, const __nv_bfloat16* nw, float eps, int K, int hd,
                            uint32_t tag, const Smem& s, int ct, int cw, int lane) {
  const int m = K / (2 * CT), wph = hd / 64, q0 = cw * 32 * m + lane;
  float* red = s.sc + cw * MAX_PAIRS;                          // [m]: pair j's sum over the warp
  uint32_t* xb = reinterpret_cast<uint32_t*>(s.sc + 256);      // [K / 2]: x's bf16 pair q at xb[q]
  uint32_t wn[2];  // pair j's norm weights: wn[j % wph]
#pragma unroll
  for (int u = 0; u < 2; ++u)
    wn[u] = u < wph ? __ldg(reinterpret_cast<const uint32_t*>(nw + ((2 * (q0 + 32 * u)) & (hd - 1)))) : 0u;
  for (int g0 = 0; g0 < m; g0 += GATED_GROUP) {
    const int n = min(GATED_GROUP, m - g0), qg = q0 + 32 * g0;
    uint64_t zw[2 * GATED_GROUP], xw[2 * GATED_GROUP];
    z.issue_pairs(qg, 32, n, zw);
    x.src.issue_pairs(qg, 32, n, xw);  // (x: a source, program.py)
    z.settle_pairs(qg, 32, n, zw, tag);
#pragma unroll
    for (int j = 0; j < GATED_GROUP; ++j)
      if (j < n) {
        const float z0 = word_value(zw[2 * j], z.kind), z1 = word_value(zw[2 * j + 1], z.kind);
        *reinterpret_cast<float2*>(s.xs + xpos(2 * (qg + 32 * j))) =
            make_float2(z0 / (1.f + __expf(-z0)), z1 / (1.f + __expf(-z1)));
      }
    if (g0 == 0) prof_mark(ct, PF_S2);  // (z's first group staged)
    x.src.settle_pairs(qg, 32, n, xw, tag);
#pragma unroll
    for (int j = 0; j < GATED_GROUP; ++j)
      if (j < n) {
        const float v0 = word_value(xw[2 * j], x.src.kind), v1 = word_value(xw[2 * j + 1], x.src.kind);
        const __nv_bfloat162 b = __floats2bfloat162_rn(v0, v1);  // (exact: bf16 outputs)
        xb[qg + 32 * j] = *reinterpret_cast<const uint32_t*>(&b);
        const float p = warp_sum(v0 * v0 + v1 * v1);
        if (lane == 0) red[g0 + j] = p;
      }
    if (g0 == 0) prof_mark(ct, PF_S3);  // (x's first group)
  }
  prof_mark(ct, PF_S1);
  __syncwarp();
  // The norm, a head at a time: its (at most 2) warp sums loaded together, summed in order, times 1 / hd
  // (exact: a power of two), then its pairs.
  const float ihd = 1.f / hd;
  for (int j0 = 0; j0 < m; j0 += wph) {
    const float t = wph == 2 ? red[j0] + red[j0 + 1] : red[j0];
    const float r = rsqrtf(t * ihd + eps);
#pragma unroll
    for (int u = 0; u < 2; ++u)
      if (u < wph) {
        const int q = q0 + 32 * (j0 + u);
        const float2 w = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wn[u]));
        const float2 xv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(xb + q));
        float2* xp = reinterpret_cast<float2*>(s.xs + xpos(2 * q));
        const float2 g = *xp;
        *xp = make_float2(bf(bf(bf(xv.x * r) * w.x) * g.x), bf(bf(bf(xv.y * r) * w.y) * g.y));
      }
  }
  prof_mark(ct, PF_S4);
}

// ---- one row's dot with x (whole warp; the result on every lane) -------------------------------------
// p + the dot of 4 e4m3 weights (one 32-bit word) with x4
__device__ __forceinline__ float fma4_e4m3(uint32_t w, const float4& x4, float p) {
  const uint32_t lo = fp8x2_to_f16x2(w), hi = fp8x2_to_f16x2(w >> 16);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  p = fmaf(a.x, x4.x, p);
  p = fmaf(a.y, x4.y, p);
  p = fmaf(b.x, x4.z, p);
  return fmaf(b.y, x4.w, p);
}

__device__ __forceinline__ float row_dot(const uint8_t* row, int wtype, int K, const float* ws_row, const float* xs,
                                         int lane) {
  float acc = 0.f;
  for (int base = 0; base < K; base += 512) {
    const float4* xv = reinterpret_cast<const float4*>(xs + base) + lane;  // float4 q at xv[q * 32]
    float part = 0.f;
    if (wtype == W_E4M3) {
      const uint4 v = *reinterpret_cast<const uint4*>(row + base + lane * 16);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) part = fma4_e4m3(words[q], xv[q * 32], part);
      acc = fmaf(part, ws_row[(base + lane * 16) / 128], acc);
    } else {
      const uint4* pw = reinterpret_cast<const uint4*>(row + 2 * (base + lane * 16));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v = pw[h];
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
        const float4 x0 = xv[(2 * h) * 32], x1 = xv[(2 * h + 1) * 32];
        const float x8[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[q]));
          part = fmaf(f.x, x8[2 * q], part);
          part = fmaf(f.y, x8[2 * q + 1], part);
        }
      }
      acc += part;
    }
  }
  return warp_sum(acc);
}

// two e4m3 rows' dots with the same x, each x load serving both (whole warp; the results on every lane)
__device__ __forceinline__ float2 row_dot2(const uint8_t* row0, const uint8_t* row1, int K, const float* ws0,
                                           const float* ws1, const float* xs, int lane) {
  float acc0 = 0.f, acc1 = 0.f;
  for (int base = 0; base < K; base += 512) {  // (unrolled by 2: the same step time, 2026-12-02b)
    const float4* xv = reinterpret_cast<const float4*>(xs + base) + lane;
    const uint4 v0 = *reinterpret_cast<const uint4*>(row0 + base + lane * 16);
    const uint4 v1 = *reinterpret_cast<const uint4*>(row1 + base + lane * 16);
    const uint32_t w0[4] = {v0.x, v0.y, v0.z, v0.w}, w1[4] = {v1.x, v1.y, v1.z, v1.w};
    float p0 = 0.f, p1 = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 x4 = xv[q * 32];
      p0 = fma4_e4m3(w0[q], x4, p0);
      p1 = fma4_e4m3(w1[q], x4, p1);
    }
    const int b = (base + lane * 16) / 128;
    acc0 = fmaf(p0, ws0[b], acc0);
    acc1 = fmaf(p1, ws1[b], acc1);
  }
  return make_float2(warp_sum(acc0), warp_sum(acc1));
}

// ---- routing (one whole warp) ----------------------------------------------------------------------
#ifndef MEGA_TOPK_REDUX
#define MEGA_TOPK_REDUX 1  // each top-k round's warp pick by redux.sync (max value, then min index); 0: shuffles
#endif
// logits [E + 1] (bf16 words) -> ids[0..top_k] (the picks of an fp32 softmax, ties to the lower index, then
// the shared expert E) and weights (renormalised picks, then sigmoid of logit E), into r[0..15], r[16..31]
__device__ void route_warp(const Source& lg, int E, int top_k, uint32_t tag, int* r, int lane, int instr) {
  constexpr int PER = MAX_EXPERTS / 32;
  // The lane's logits j * 32 + lane (j < nl) and, on lane 0, the shared expert's gate logit (row E): all their
  // loads in flight at once, then settled (wait on the first late word, then load them all again), so the
  // routing costs about one L2 round trip after the router's last writer, not one per group of FETCH_GROUP
  // and one more for the gate.
  const int nl = (E - lane + 31) / 32;
  uint64_t w[PER], wg = 0;
  for (;;) {
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (j < nl) w[j] = ld_relaxed_u64(lg.y + j * 32 + lane);
    if (lane == 0) wg = ld_relaxed_u64(lg.y + E);
    const int late = first_late(w, nl, tag);
    const int e = late >= 0 ? late * 32 + lane : lane == 0 && !tagged(wg, tag) ? E : -1;
    if (e < 0 || !tagged(poll_until(lg.y, e, tag), tag)) break;  // (settled, or the step aborted)
  }
  if (MEGA_PROF) {
    __syncwarp();
    if (lane == 0) prof_set(instr, PF_P_SETTLED, cycles());
  }
  float num[PER];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    num[j] = j < nl ? word_value(w[j], lg.kind) : -INFINITY;
    m = fmaxf(m, num[j]);
  }
  m = warp_max(m);
  float tot = 0.f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    num[j] = j * 32 + lane < E ? expf(num[j] - m) : -1.f;
    tot += num[j] > 0.f ? num[j] : 0.f;
  }
  tot = warp_sum(tot);
  float picked = 0.f;
  for (int k = 0; k < top_k; ++k) {
    float bv = -1.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (num[j] > bv) bv = num[j], bi = j * 32 + lane;  // ascending index: the first of ties stays
#if MEGA_TOPK_REDUX
    {  // the warp's largest value (a value >= 0 orders as its bits; none: -1, key 0), then the lowest index of
       // the lanes that hold it: the butterfly's pick in two redux.sync
      const uint32_t key = bv > 0.f ? __float_as_uint(bv) : 0u;
      const uint32_t best = __reduce_max_sync(0xffffffffu, key);
      bi = static_cast<int>(__reduce_min_sync(0xffffffffu, key == best ? static_cast<uint32_t>(bi) : 0xffffffffu));
      bv = best != 0u ? __uint_as_float(best) : 0.f;
    }
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
#endif
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (j * 32 + lane == bi) num[j] = -1.f;
    const float prob = bv / tot;
    picked += prob;
    if (lane == 0) {
      r[k] = bi;
      reinterpret_cast<float*>(r)[16 + k] = prob;
    }
  }
  __syncwarp();
  if (lane < top_k) reinterpret_cast<float*>(r)[16 + lane] /= picked;
  if (lane == 0) {
    const float g = word_value(wg, lg.kind);
    r[top_k] = E;
    reinterpret_cast<float*>(r)[16 + top_k] = 1.f / (1.f + expf(-g));
  }
  __syncwarp();
}

// ---- the tensor-core consumers (the MEGA_MMA build) ------------------------------------------------------
// e4m3 tiles of 16 rows x K (K <= 2048: GEMV chunks, GateUp's 8 + 8 rows, Down's pieces) on mma.sync: warp cw
// takes columns [cw K / NCW, (cw + 1) K / NCW), f16 operands (e4m3 weights and bf16-valued x, both exact in
// f16), fp32 accumulation per 64 columns times the rows' block scale (ws_lo: rows 0-7, ws_hi: rows 8-15).
// -> the warp's partials of rows g and g + 8 on the lanes with tig == 0. The warps' partials meet in shared
// memory (tile_sum).
__device__ __forceinline__ float2 tile_mma(const uint8_t* tile, int K, const __half* xh, const float* ws_lo,
                                           const float* ws_hi, int cw, int lane) {
  const int kw = K / NCW, g = lane >> 2, tig = lane & 3;
  const uint8_t* ra = tile + g * K + tig * 16;
  const __half* xp = xh + tig * 16;
  float r0 = 0.f, r1 = 0.f;
  for (int k0 = cw * kw; k0 < (cw + 1) * kw; k0 += 64) {
    float d[4][4] = {};
    mma_k64(d, ra, ra + 8 * K, xp, k0, g);
    r0 = fmaf((d[0][0] + d[1][0]) + (d[2][0] + d[3][0]), ws_lo[k0 / 128], r0);
    r1 = fmaf((d[0][2] + d[1][2]) + (d[2][2] + d[3][2]), ws_hi[k0 / 128], r1);
  }
  return make_float2(r0, r1);
}
// x in f16 for tile_mma: past the fp32 copy's first 2,304 floats (x of K <= 2048 fits below), or from 0 where
// the fp32 copy is not kept (Down's activations)
__device__ __forceinline__ __half* xh_of(const Smem& s, bool alone) {
  return reinterpret_cast<__half*>(alone ? s.xs : s.xs + 2304);
}
// the fp32 x (permuted) copied into xh (f16, in order), then a barrier
__device__ void stage_f16(const Smem& s, int K, int ct) {
  __half* xh = xh_of(s, false);
  for (int e = ct; e < K; e += CT) xh[e] = __float2half_rn(s.xs[xpos(e)]);
  consumers_sync(CT);
}
// the warps' partials of one tile summed in warp order -> row r's dot on lane r < 16 of every warp (red: two
// [NCW][16] buffers used in turn, so one barrier per tile)
__device__ __forceinline__ float tile_sum(float2 part, float* red, int& buf, int cw, int lane) {
  float* r = red + buf * NCW * 16;
  if ((lane & 3) == 0) {
    r[cw * 16 + (lane >> 2)] = part.x;
    r[cw * 16 + (lane >> 2) + 8] = part.y;
  }
  consumers_sync(CT);
  float t = 0.f;
  if (lane < 16)
#pragma unroll
    for (int w = 0; w < NCW; ++w) t += r[w * 16 + lane];
  buf ^= 1;
  return t;
}

// ---- GEMV chunks on FP8 wgmma (the MEGA_WGMMA build; experiments/mega_chunk_bench.cu modes 6, 7 measured it) -----
// A 16-row chunk of K = 2048 e4m3 is A of m64n8k32: W's row-major [16, 2048] viewed as [64, 512] (view row
// m = 4 r + s: W row r's K segment s), landed by TMA as 4 K blocks of [64][128 B], 128-byte swizzled (the
// canonical K-major A). B is x as two e4m3 terms in 8 columns, n = 2 s + h (segment s, hi h = 0 or lo h = 1;
// no swizzle, [512 / 16][8][16 B]): hi = e4m3(x 2^e), lo = e4m3(x 2^e - hi), with one power of two 2^e per 128
// columns setting the block's largest into [128, 256). hi + lo is exact for bf16 x down to 2^-9 of the block's
// largest (smaller ones lose bits in e4m3's subnormals). D[m][n] is used where n / 2 = m % 4.
constexpr int X8_K = 2048, X8_OFF = 2560, X8F_OFF = 3584;  // (floats into xs, past x's 2048)
__device__ __forceinline__ uint8_t* x8_of(const Smem& s) { return reinterpret_cast<uint8_t*>(s.xs + X8_OFF); }
__device__ __forceinline__ float* x8f_of(const Smem& s) { return s.xs + X8F_OFF; }  // [16] 2^-e per block

// A lane's 4 columns (c0..c0 + 3) of a 128-column block of x (fp32, permuted: xpos keeps them together) as two e4m3
// terms, 4 bytes each (hi, lo), scaled by the block's power of two (its largest into [128, 256): a warp max, so the
// whole warp calls it for one block) -> 2^-e, the factor that undoes it
__device__ __forceinline__ float x8_terms(const float* xs, int c0, uint32_t& hi, uint32_t& lo) {
  const float4 v4 = *reinterpret_cast<const float4*>(xs + xpos(c0));
  const float v[4] = {v4.x, v4.y, v4.z, v4.w};
  const float m = warp_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
  const int e = static_cast<int>((__float_as_uint(m) >> 23) & 0xffu) - 127;
  const int sh = m > 0.f ? min(max(7 - e, -120), 120) : 0;
  const float up = __uint_as_float(static_cast<uint32_t>(127 + sh) << 23);
  hi = 0, lo = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float xv = v[i] * up;
    const __nv_fp8_storage_t h = __nv_cvt_float_to_fp8(xv, __NV_SATFINITE, __NV_E4M3);
    const float hv = __half2float(__half(__nv_cvt_fp8_to_halfraw(h, __NV_E4M3)));
    hi |= static_cast<uint32_t>(h) << (8 * i);
    lo |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(xv - hv, __NV_SATFINITE, __NV_E4M3)) << (8 * i);
  }
  return __uint_as_float(static_cast<uint32_t>(127 - sh) << 23);
}

// xs (fp32, permuted: xpos) -> B's two terms b8 and the blocks' 2^-e xf (warp cw: blocks cw and cw + 8, lane 4
// columns of each); made visible to wgmma (the caller's barrier follows)
__device__ void stage_x8(const float* xs, uint8_t* b8, float* xf, int cw, int lane) {
  for (int b = cw; b < X8_K / 128; b += NCW) {
    const int c0 = b * 128 + lane * 4;
    uint32_t hi, lo;
    const float f = x8_terms(xs, c0, hi, lo);
    const int sg = c0 / 512, kk = c0 % 512, at = (kk / 16) * 128 + 2 * sg * 16 + kk % 16;
    *reinterpret_cast<uint32_t*>(b8 + at) = hi;
    *reinterpret_cast<uint32_t*>(b8 + at + 16) = lo;
    if (lane == 0) xf[b] = f;
  }
  fence_proxy_async();
}

// One chunk's 16 dots on the calling warpgroup (warps w4 = 0..3 of it, all converged): ws the chunk's 16 block
// scales, b8 and xf x's terms and powers of two (stage_x8). -> on lanes 0 and 16 of warp w4: rows 4 w4 + lane / 16
// (.x) and that + 2 (.y)
__device__ __forceinline__ float2 wg_dot16(const uint8_t* chunk, const float* ws, const uint8_t* b8, const float* xf,
                                          int lane) {
  // (the descriptors' start address field is addr >> 4, and shared addresses stay below 2^18: offsets add there)
  const uint64_t da0 = smem_desc(smem_u32(chunk), 16, 1024, 1), db0 = smem_desc(smem_u32(b8), 128, 0, 0);
  float acc[4][4];  // one chain per 128-column block of a segment (block scales per 128 columns)
  wgmma_fence();
#pragma unroll
  for (int kb = 0; kb < 4; ++kb)
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // 32 columns: +32 bytes within A's swizzled rows, B's next 2 core matrices
      const uint64_t da = da0 + ((kb * 8192 + j * 32) >> 4), db = db0 + ((kb * 8 + j * 2) * 128 >> 4);
      if (j == 0) wgmma_m64n8k32<0>(acc[kb], da, db);
      else wgmma_m64n8k32<1>(acc[kb], da, db);
    }
  wgmma_commit_wait();
  // this lane's D: view rows 16 w4 + g and + 8 (segment g % 4), columns 2 t, 2 t + 1 (segment t's hi, lo)
  const int g = lane >> 2, t = lane & 3;
  float v0 = 0.f, v1 = 0.f;
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    const float f = ws[t * 4 + kb] * xf[t * 4 + kb];
    v0 = fmaf(acc[kb][0] + acc[kb][1], f, v0);
    v1 = fmaf(acc[kb][2] + acc[kb][3], f, v1);
  }
  if ((g & 3) != t) v0 = v1 = 0.f;
#pragma unroll
  for (int o = 1; o < 16; o <<= 1)  // the 4 segments of rows 4 w4 + lane / 16 (and + 2) in each half-warp
    v0 += __shfl_xor_sync(0xffffffffu, v0, o), v1 += __shfl_xor_sync(0xffffffffu, v1, o);
  return make_float2(v0, v1);
}
}  // namespace mega
