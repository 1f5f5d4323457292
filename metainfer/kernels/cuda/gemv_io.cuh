// Part of gemv.cu (one translation unit: gemv.cu includes its parts in order): what the consumers read before
// their chunks and write after them: the routing, the x prologue, the conv epilogue.
#pragma once

namespace {
// p[i] as fp32, loaded past L1 (the previous kernel's output)
__device__ __forceinline__ float bf16_at(const __nv_bfloat16* p, int i) {
  return __uint_as_float(static_cast<uint32_t>(__ldcg(reinterpret_cast<const unsigned short*>(p) + i)) << 16);
}

// an order-preserving key of a float (-0 as +0; 0 is below every float's key: a removed pick)
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t b = __float_as_uint(v + 0.f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Routing by the producer warp (lane l holds experts l + 32 i): the top_k experts by router logit, largest first,
// the lowest index among equal logits (the picks of routing.softmax_topk, which ranks the same logits the same way).
// The picks need no exp and no sum; each is found when the producer first needs it (route_next), so a CTA whose
// next chunk belongs to pair 0 or 1 lands it after one or two rounds; CTA 0 then writes the weights (route_weights).
struct Route {
  uint32_t key[MOE_MAX_E / 32];  // order_key of the logits; 0: not an expert, or picked
};
__device__ __forceinline__ void route_load(const Moe& m, Route& r, int lane) {
#pragma unroll
  for (int i = 0; i < MOE_MAX_E / 32; ++i) {
    const int e = lane + 32 * i;
    r.key[i] = e < m.E ? order_key(bf16_at(m.logits, e)) : 0u;
  }
}
// the next pick (the same on every lane), removed from r
__device__ __forceinline__ int route_next(Route& r, int lane) {
  uint32_t bk = 0u;
  int bi = 0;
#pragma unroll
  for (int i = 0; i < MOE_MAX_E / 32; ++i)  // the lane's largest (its lowest index among equal keys)
    if (r.key[i] > bk) bk = r.key[i], bi = i;
  const uint32_t kmax = __reduce_max_sync(0xffffffffu, bk);
  const int best = static_cast<int>(
      __reduce_min_sync(0xffffffffu, bk == kmax ? static_cast<uint32_t>(lane + 32 * bi) : ~0u));
#pragma unroll
  for (int i = 0; i < MOE_MAX_E / 32; ++i)
    if (lane + 32 * i == best) r.key[i] = 0u;
  return best;
}
// CTA 0, all picks known: tw (the picks' softmax probabilities over the E logits, renormalised; the shared expert's
// sigmoid(gate) last) and ids
__device__ void route_weights(const Moe& m, const int* pick, int lane) {
  float l[MOE_MAX_E / 32], mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < MOE_MAX_E / 32; ++i) {
    l[i] = lane + 32 * i < m.E ? bf16_at(m.logits, lane + 32 * i) : -INFINITY;
    mx = fmaxf(mx, l[i]);
  }
  mx = gemv::warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < MOE_MAX_E / 32; ++i) sum += lane + 32 * i < m.E ? expf(l[i] - mx) : 0.f;
  sum = gemv::warp_sum(sum);
  const float p = lane < m.top_k ? expf(bf16_at(m.logits, pick[lane]) - mx) / sum : 0.f;
  const float psum = gemv::warp_sum(p);
  if (lane < m.top_k) m.tw[lane] = p / psum, m.ids[lane] = pick[lane];
  if (lane == m.top_k) m.tw[lane] = 1.f / (1.f + expf(-bf16_at(m.logits, m.E))), m.ids[lane] = m.E;
}

// Pre's x into xs (fp32 of the bf16 values, at gemv::xpos): consumer thread t holds columns 8 t .. 8 t + 7
// the sum of the W rows' columns c0..c0 + 7 weighted by tw, in slot order (the loads unrolled: the model's
// 9 rows issue in two waves, 8 then 1)
__device__ __forceinline__ void pre_rows(const Pre& p, float (&acc)[8]) {
  const int c0 = threadIdx.x * 8;
  int j0 = 0;
#pragma unroll
  for (int j = j0; j < PRE_MAX_W; ++j) {
    if (j < p.W) {
      const float t = __ldcg(p.tw + j);
      const float4 a = __ldcg(reinterpret_cast<const float4*>(p.rows + (size_t)j * KK + c0));
      const float4 b = __ldcg(reinterpret_cast<const float4*>(p.rows + (size_t)j * KK + c0) + 1);
      const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = fmaf(t, v[i], acc[i]);
    }
  }
}

__device__ void stage_pre(const Pre& p, float* xs, float* red, int cw, int lane, Tl& tl) {
  const int c0 = threadIdx.x * 8;
  float acc[8] = {};
  pre_rows(p, acc);
  if (threadIdx.x == 0) tl.at(TL_ROWS);  // (the timeline build: when thread 0's rows are in)
  const uint4 rv = __ldcg(reinterpret_cast<const uint4*>(p.res + c0));
  const uint4 wv = __ldg(reinterpret_cast<const uint4*>(p.w + c0));
  const uint32_t rw[4] = {rv.x, rv.y, rv.z, rv.w}, ww[4] = {wv.x, wv.y, wv.z, wv.w};
  float r[8], ss = 0.f;
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float res = __uint_as_float(i & 1 ? rw[i / 2] & 0xffff0000u : rw[i / 2] << 16);
    const float sum = __bfloat162float(__float2bfloat16_rn(acc[i]));  // the combine's rounding
    const __nv_bfloat16 rb = __float2bfloat16_rn(sum + res);
    r[i] = __bfloat162float(rb);
    ss = fmaf(r[i], r[i], ss);
    const uint32_t bits = __bfloat16_as_ushort(rb);
    out[i / 2] = i & 1 ? out[i / 2] | (bits << 16) : bits;
  }
  if (blockIdx.x == 0) *reinterpret_cast<uint4*>(p.new_res + c0) = make_uint4(out[0], out[1], out[2], out[3]);
  const float rstd = rsqrtf(gemv::block_sum(ss, red, cw, lane) / KK + p.eps);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float w = __uint_as_float(i & 1 ? ww[i / 2] & 0xffff0000u : ww[i / 2] << 16);
    xs[gemv::xpos(c0 + i)] = __bfloat162float(__float2bfloat16_rn(r[i] * rstd * (1.f + w)));
  }
}

// The conv epilogue's loads for row n (a row < n_conv), issued before the chunk's dots so that their latency
// hides behind them: the row's conv weights and its slot's state (zeros without one)
struct ConvRow {
  float w[CONV_K];
  __nv_bfloat16 prev[CONV_K - 1];
};
__device__ __forceinline__ ConvRow conv_loads(int n, const Conv& cv, long long slot, bool has) {
  ConvRow r;
  const __nv_bfloat16* wn = cv.w + n * CONV_K;
  const __nv_bfloat16* sb = cv.state + slot * cv.s_slot + n;
#pragma unroll
  for (int j = 0; j < CONV_K; ++j) r.w[j] = __bfloat162float(wn[j]);
#pragma unroll
  for (int j = 0; j < CONV_K - 1; ++j) r.prev[j] = has ? sb[j * cv.s_k] : __float2bfloat16_rn(0.f);
  return r;
}

// row n (< n_conv) from its bf16 projection yb: silu(bf16(yb w[3] + sum_j prev[j] w[j])), the state shifted
__device__ __forceinline__ __nv_bfloat16 conv_row(__nv_bfloat16 yb, int n, const ConvRow& r, const Conv& cv,
                                                  long long slot) {
  float c = __bfloat162float(yb) * r.w[CONV_K - 1];
#pragma unroll
  for (int j = 0; j < CONV_K - 1; ++j) c = fmaf(__bfloat162float(r.prev[j]), r.w[j], c);
  __nv_bfloat16* sb = cv.state + slot * cv.s_slot + n;
#pragma unroll
  for (int j = 1; j < CONV_K - 1; ++j) sb[(j - 1) * cv.s_k] = r.prev[j];
  sb[(CONV_K - 2) * cv.s_k] = yb;
  c = __bfloat162float(__float2bfloat16_rn(c));  // the conv weight's dtype
  return __float2bfloat16_rn(c / (1.f + __expf(-c)));
}
}  // namespace
