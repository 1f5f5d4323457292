// The megakernel's token mixers: the DeltaNet state update, split-KV attention, the gated combine.
// Part of mega.cu (one translation unit: mega.cu includes the parts in order).
#pragma once

#include "mega_dense.cuh"

namespace mega {
// the gated delta rule on one (value head, 32-column block) of the state: thread (cw, lane) holds column lane,
// rows cw * 16 .. + 15 (Dk = 128)
__device__ void op_delta(Ctx& c, const Instr& in) {
  const int hk = in.i[0], Hv = in.i[1], Dk = in.i[2], Dv = in.i[3], nblk = Dv / 32;
  const Source proj(c.prog, in.i[6], 0);
  const long long* step = ptr<const long long>(in.p[8]);
  const long long slot = step[STEP_STATE_SLOT];
  const bool has = step[STEP_HAS_STATE] != 0;
  float* qn = c.s.sc;           // [128]
  float* kn = qn + 128;         // [128]
  float* red = kn + 128;        // [NCW][32]
  float* gates = red + NCW * 32;  // decay, beta
  for (int item = c.first, n = n_units(in); item < n; item += gridDim.x) {
    const int h = item / nblk, cb = item % nblk, kh = h / (Hv / hk), col = cb * 32 + c.lane;
    float* S = ptr<float>(in.p[0]) + (((size_t)slot * Hv + h) * Dk) * Dv + col;
    float st[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) st[r] = has ? S[(size_t)(c.cw * 16 + r) * Dv] : 0.f;  // before the wait
    consumers_sync(CT);  // the scratch is free
    if (c.cw < 2) {  // warp 0: q, warp 1: k, l2-normalised (q also scaled by Dk^-0.5)
      const int off = (c.cw == 0 ? 0 : hk * Dk) + kh * Dk;
      float v[4], ss = 0.f;
      proj.fetch<4>(off + c.lane, 32, 4, v, c.tag);  // (all 4 in flight: KB-0090)
#pragma unroll
      for (int j = 0; j < 4; ++j) ss += v[j] * v[j];
      const float r = rsqrtf(warp_sum(ss) + 1e-6f) * (c.cw == 0 ? rsqrtf((float)Dk) : 1.f);
#pragma unroll
      for (int j = 0; j < 4; ++j) (c.cw == 0 ? qn : kn)[j * 32 + c.lane] = v[j] * r;
    } else if (c.cw == 2 && c.lane == 0) {
      float ab[2];  // a (at i[5] + h) and b (at i[4] + h), both loads in flight
      proj.fetch<2>(in.i[5] + h, in.i[4] - in.i[5], 2, ab, c.tag);
      const float a = ab[0] + bf_at(ptr<const __nv_bfloat16>(in.p[2]), h), b = ab[1];
      const float sp = a > 20.f ? a : log1pf(expf(a));
      gates[0] = expf(-expf(bf_at(ptr<const __nv_bfloat16>(in.p[1]), h)) * sp);
      gates[1] = bf(1.f / (1.f + expf(-b)));
    }
    const float v = proj(2 * hk * Dk + h * Dv + col, c.tag);
    consumers_sync(CT);
    const float decay = gates[0], beta = gates[1];
    float kv = 0.f;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      st[r] *= decay;
      kv = fmaf(st[r], kn[c.cw * 16 + r], kv);
    }
    red[c.cw * 32 + c.lane] = kv;
    consumers_sync(CT);
    kv = 0.f;
#pragma unroll
    for (int w = 0; w < NCW; ++w) kv += red[w * 32 + c.lane];
    const float delta = (v - kv) * beta;
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      st[r] = fmaf(kn[c.cw * 16 + r], delta, st[r]);
      o = fmaf(st[r], qn[c.cw * 16 + r], o);
      S[(size_t)(c.cw * 16 + r) * Dv] = st[r];
    }
    consumers_sync(CT);  // every thread read red's kv
    red[c.cw * 32 + c.lane] = o;
    consumers_sync(CT);
    if (c.cw == 0) {
      o = 0.f;
#pragma unroll
      for (int w = 0; w < NCW; ++w) o += red[w * 32 + c.lane];
      store_word(ptr<uint64_t>(in.p[4]), h * Dv + col, o, OUT_BF16, c.tag);
    }
  }
}

// eight bf16 values (16 bytes) as floats
__device__ __forceinline__ void bf16x8(const uint4 v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 t = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
    f[2 * j] = t.x;
    f[2 * j + 1] = t.y;
  }
}

// 16 bytes of a cache row (read-only here: the non-coherent path)
__device__ __forceinline__ uint4 ld_row(const __nv_bfloat16* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// qk_norm_rope's math on one head of 256 (consumer thread t holds dim t): RMSNorm (1 + w), NeoX RoPE on the
// first rd dims at pos; raw[] in shared memory. -> fp32
__device__ float norm_rope(const float* raw, const __nv_bfloat16* w, float eps, float pos, const float* inv_freq,
                           int rd, float* red, int ct, int cw, int lane) {
  const int D = CT, half = rd / 2;
  const float x = raw[ct];
  const float rstd = rsqrtf(block_sum(x * x, red, cw, lane) / D + eps);
  const int partner = ct < half ? ct + half : (ct < rd ? ct - half : ct);
  const float xn = x * rstd * (1.f + bf_at(w, ct)), xpn = raw[partner] * rstd * (1.f + bf_at(w, partner));
  if (ct >= rd) return xn;
  float sn, cs;
  sincosf(pos * inv_freq[ct < half ? ct : ct - half], &sn, &cs);
  return xn * cs + (ct < half ? -xpn : xpn) * sn;
}

#ifndef MEGA_ATTEND_ROWS  // cache rows a warp loads at once, in registers under the 168-register cap (16 spill,
#define MEGA_ATTEND_ROWS (MEGA_MMA ? 4 : 8)  // and 8 in the mma.sync build; 8: 2.238 vs 4: 2.245 ms, 2026-12-04c)
#endif
constexpr int ATT_R = MEGA_ATTEND_ROWS;

// split-KV attention of one (q head, split): warp cw scores positions lo + cw + j * NCW (lane: 8 dims). head_dim
// D = CT and the KV block a power of two (program.py), so a position's cache row is shifts and masks. The cache
// rows are last steps' data: prefetched into L2 before q is polled, then loaded ATT_R rows a warp at once in
// each pass (one L2 round trip a round, not one per 4 rows).
__device__ void op_attend(Ctx& c, const Instr& in) {
  constexpr int D = CT;
  const int hq = in.i[0], hkv = in.i[1], rd = in.i[3], ns = in.i[4], bs = in.i[5], lbs = __ffs(bs) - 1;
  const Source qkv(c.prog, in.i[6], in.i[7]);
  const long long* step = ptr<const long long>(in.p[8]);
  const int L = (int)step[STEP_SEQ_LEN];
  const float pos = (float)step[STEP_POS];
  const long long kv_slot = step[STEP_KV_SLOT];
  const int* bt = ptr<const int>(in.p[6]);
  __nv_bfloat16* kc = ptr<__nv_bfloat16>(in.p[0]);
  __nv_bfloat16* vc = ptr<__nv_bfloat16>(in.p[1]);
  const float* inv_freq = ptr<const float>(in.p[5]);
  // position t's cache row of KV head kvh (bt: the block table)
  auto row_of = [&](const __nv_bfloat16* cache, int t, int kvh) {
    const size_t row = (size_t)bt[t >> lbs] << lbs | (t & (bs - 1));
    return cache + (row * hkv + kvh) * D;
  };
  const float scale = in.f[1] * 1.4426950408889634f;
  float* q = c.s.xs;          // [256] the normed, rotated query (bf16 values)
  float* kn = q + 256;        // [256] this step's key, normed and rotated (bf16 values)
  float* vn = kn + 256;       // [256] this step's value
  float* raw = vn + 256;      // [256]
  float* score = raw + 256;   // [MAX_SCORES]
  float* red = c.s.sc;        // [NCW] sums; then [NCW][D] partial outputs
  const int per = (L + ns - 1) / ns;
  for (int item = c.first, n = n_units(in); item < n; item += gridDim.x) {
    const int h = item / ns, sp = item % ns, kvh = h / (hq / hkv);
    const int lo = sp * per, hi = min(lo + per, L);
    // the cache's rows [lo, min(hi, L - 1)) into L2 (lanes 0-15: key rows, 16-31: value rows)
    for (int t = lo + c.cw + (c.lane % 16) * NCW; t < min(hi, L - 1); t += 16 * NCW)
      l2_prefetch(row_of(c.lane < 16 ? kc : vc, t, kvh), D * 2);
    uint64_t* y = ptr<uint64_t>(in.p[4]) + (size_t)(h * ns + sp) * (D + 2);
    consumers_sync(CT);
    raw[c.ct] = qkv(h * 2 * D + c.ct, c.tag);
    consumers_sync(CT);
    const float qv = bf(norm_rope(raw, ptr<const __nv_bfloat16>(in.p[2]), in.f[0], pos, inv_freq, rd, red, c.ct, c.cw,
                                  c.lane));
    consumers_sync(CT);
    prof_mark(c.ct, PF_S1);  // (q normed)
    q[c.ct] = qv;
    const bool last = lo <= L - 1 && L - 1 < hi;
    if (last) {  // this step's key and value (used for position L - 1 instead of the cache's row)
      raw[c.ct] = qkv(2 * hq * D + kvh * D + c.ct, c.tag);
      consumers_sync(CT);
      const float kv = bf(norm_rope(raw, ptr<const __nv_bfloat16>(in.p[3]), in.f[0], pos, inv_freq, rd, red, c.ct,
                                    c.cw, c.lane));
      kn[c.ct] = kv;
      vn[c.ct] = qkv(2 * hq * D + hkv * D + kvh * D + c.ct, c.tag);
      if (h % (hq / hkv) == 0) {  // one item per KV head stores them
        kc[((size_t)kv_slot * hkv + kvh) * D + c.ct] = __float2bfloat16_rn(kv);
        vc[((size_t)kv_slot * hkv + kvh) * D + c.ct] = __float2bfloat16_rn(vn[c.ct]);
      }
    }
    consumers_sync(CT);
    prof_mark(c.ct, PF_S2);  // (this step's key and value, where the split has them)
    if (lo >= hi) {  // an empty split
      store_word(y, c.ct, 0.f, OUT_F32, c.tag);
      if (c.ct < 2) store_word(y, D + c.ct, c.ct == 0 ? -INFINITY : 0.f, OUT_F32, c.tag);
      continue;
    }
    // pass 1: the scores (fp32; q and k bf16 values)
    float qr[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) qr[j] = q[c.lane * 8 + j];
    // the cache's positions [lo, hc); this step's (L - 1, from kn and vn) after them, on warp w_last
    const int hc = last ? L - 1 : hi, t_first = lo + c.cw;
    const bool w_last = last && (L - 1 - lo) % NCW == c.cw;
    // a round's ATT_R cache rows of this warp, all loaded before any is used: positions t0 + j NCW, the lane's
    // 8 dims (past hc: the last row again, unused)
    auto load_round = [&](const __nv_bfloat16* cache, int t0, uint4 (&r)[ATT_R]) {
#pragma unroll
      for (int j = 0; j < ATT_R; ++j) r[j] = ld_row(row_of(cache, min(t0 + j * NCW, hc - 1), kvh) + c.lane * 8);
    };
    float m = -INFINITY;
    for (int t0 = t_first; t0 < hc; t0 += ATT_R * NCW) {
      uint4 kr[ATT_R];
      load_round(kc, t0, kr);
#pragma unroll
      for (int j = 0; j < ATT_R; ++j) {
        const int t = t0 + j * NCW;
        if (t < hc) {
          float k8[8], part = 0.f;
          bf16x8(kr[j], k8);
#pragma unroll
          for (int e = 0; e < 8; ++e) part = fmaf(qr[e], k8[e], part);
          const float sc = warp_sum(part) * scale;
          if (c.lane == 0) score[t - lo] = sc;
          m = fmaxf(m, sc);
        }
      }
    }
    if (w_last) {
      float part = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) part = fmaf(qr[j], kn[c.lane * 8 + j], part);
      const float sc = warp_sum(part) * scale;
      if (c.lane == 0) score[L - 1 - lo] = sc;
      m = fmaxf(m, sc);
    }
    m = warp_max(m);
    if (c.lane == 0) red[c.cw] = m;
    consumers_sync(CT);
    prof_mark(c.ct, PF_S3);  // (pass 1 done)
    m = -INFINITY;
#pragma unroll
    for (int w = 0; w < NCW; ++w) m = fmaxf(m, red[w]);
    // pass 2: p = exp2(score - m); the sum of p, and bf16(p) times v (a round's value rows loaded at once)
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, lsum = 0.f;
    for (int t0 = t_first; t0 < hc; t0 += ATT_R * NCW) {
      uint4 vr[ATT_R];
      load_round(vc, t0, vr);
#pragma unroll
      for (int j = 0; j < ATT_R; ++j) {
        const int t = t0 + j * NCW;
        if (t < hc) {
          const float p = exp2f(score[t - lo] - m), pb = bf(p);
          lsum += p;
          float v8[8];
          bf16x8(vr[j], v8);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] = fmaf(pb, v8[e], acc[e]);
        }
      }
    }
    if (w_last) {
      const float p = exp2f(score[L - 1 - lo] - m), pb = bf(p);
      lsum += p;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = fmaf(pb, vn[c.lane * 8 + j], acc[j]);
    }
    consumers_sync(CT);  // red's maxima are read
    prof_mark(c.ct, PF_S4);  // (pass 2 done)
    float* pacc = red + NCW;  // [NCW][D]
#pragma unroll
    for (int j = 0; j < 8; ++j) pacc[c.cw * D + c.lane * 8 + j] = acc[j];
    if (c.lane == 0) red[c.cw] = lsum;
    consumers_sync(CT);
    float l = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < NCW; ++w) {
      l += red[w];
      o += pacc[w * D + c.ct];
    }
    store_word(y, c.ct, o / l, OUT_F32, c.tag);
    if (c.ct == 0) store_word(y, D, m + log2f(l), OUT_F32, c.tag);
    if (c.ct == 1) store_word(y, D + 1, l, OUT_F32, c.tag);
  }
}

#ifndef MEGA_COMBINE_GROUP
#define MEGA_COMBINE_GROUP 8  // a head's splits' words a thread has in flight (8: a pass's loads at once)
#endif

// the splits merged per head (consumer thread t: dim t), times sigmoid(gate), each rounded to bf16 first
__device__ void op_combine(Ctx& c, const Instr& in) {
  const int D = in.i[1], ns = in.i[2];  // (i[0]: hq, the units)
  const Source parts(c.prog, in.i[3], in.i[4]), qkv(c.prog, in.i[5], in.i[6]);
  constexpr int G = 8;  // splits fetched at once
  for (int h = c.first, n = n_units(in); h < n; h += gridDim.x) {
    float m = -INFINITY, lse[G], o[G];
    for (int s0 = 0; s0 < ns; s0 += G) {
      parts.fetch<MEGA_COMBINE_GROUP>((h * ns + s0) * (D + 2) + D, D + 2, min(G, ns - s0), lse, c.tag);
#pragma unroll
      for (int j = 0; j < G; ++j)
        if (s0 + j < ns) m = fmaxf(m, lse[j]);
    }
    if (m == -INFINITY) m = 0.f;
    float acc = 0.f, wsum = 0.f;
    for (int s0 = 0; s0 < ns; s0 += G) {
      const int n = min(G, ns - s0);
      parts.fetch<MEGA_COMBINE_GROUP>((h * ns + s0) * (D + 2) + D, D + 2, n, lse, c.tag);
      parts.fetch<MEGA_COMBINE_GROUP>((h * ns + s0) * (D + 2) + c.ct, D + 2, n, o, c.tag);
#pragma unroll
      for (int j = 0; j < G; ++j)
        if (j < n && lse[j] != -INFINITY) {
          const float w = exp2f(lse[j] - m);
          wsum += w;
          acc = fmaf(w, o[j], acc);
        }
    }
    const float g = qkv(h * 2 * D + D + c.ct, c.tag);
    store_word(ptr<uint64_t>(in.p[4]), h * D + c.ct, bf(acc / wsum) * bf(1.f / (1.f + expf(-g))), OUT_BF16, c.tag);
  }
}
}  // namespace mega
