// Part of gemv.cu (one translation unit: gemv.cu includes its parts in order): the DeltaNet decode step after the
// in_proj (gemv_e4m3_pre_gdn).
#pragma once

namespace {
// ---- the DeltaNet decode step after the in_proj (GDN) ----
template <bool GDN>
__device__ __forceinline__ int chunk_at(int k, int n_chunks, const Gdn& g) {  // this CTA's k-th chunk, or -1
  return chunk_of(blockIdx.x, k, gridDim.x, n_chunks, GDN ? g.hv : 0, g.waves);
}
// rows r0 .. r0 + ROWS - 1 of y are stored: lane h (< hv) adds those its head reads to count[h]
__device__ __forceinline__ void gdn_arrive(const Gdn& g, int r0, int lane) {
  if (lane >= g.hv) return;
  const int n = gdn_rows(g, r0, lane);
  if (n) {
    __threadfence();
    atomicAdd(g.count + lane, static_cast<unsigned>(n));
  }
}
// the producer of CTA h < hv: its head's state into L2 (last step's: no wait; the slot clamped, a hint only)
__device__ __forceinline__ void gdn_prefetch(const Gdn& g) {
  if (blockIdx.x >= g.hv || __ldcg(g.has) == 0) return;
  const long long slot = min(max(__ldcg(g.slots), 0ll), g.n_slots - 1);
  const char* S = reinterpret_cast<const char*>(g.state + ((size_t)slot * g.hv + blockIdx.x) * GDN_D * GDN_D);
  for (int i = 0; i < 4; ++i) l2_prefetch(S + i * 16384, 16384);
}
// Triton's fp32 exp and division as its PTX has them (tl.exp: ex2.approx.f32 of x log2 e, __expf's form; tl.sigmoid
// and `/`: div.full.f32), so that beta, rounded to bf16, takes the same bits as _gdn_decode_kernel's
__device__ __forceinline__ float tl_div(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float gdn_param(const void* p, int h, int f32) {
  return f32 ? static_cast<const float*>(p)[h] : __bfloat162float(static_cast<const __nv_bfloat16*>(p)[h]);
}
// CTA h's step, all consumer warps, after their chunks: `_gdn_decode_kernel`'s arithmetic (q, k l2-normalised, q
// scaled by D^-0.5; g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) rounded to bf16; S *= exp(g);
// delta = (v - S^T k) beta; S += k delta^T; o = S^T q). The state is in the ring: the producer lands its rows 0-63
// and 64-127 as the CTA's chunks k0 and k0 + 1 (sa, sb: their slots, on the mbarriers fa, fb; all of the CTA's
// chunks are done). Thread (cw, lane) takes columns 4 lane .. + 3 of rows 16 cw .. + 15; sc: scratch (xs, free once
// the chunks are done)
__device__ void gdn_update(const Gdn& g, const __nv_bfloat16* y, float* sc, const float* sa, const float* sb,
                           uint64_t* fa, uint64_t* fb, int k0, int cw, int lane) {
  const int h = blockIdx.x, kh = h / (g.hv / g.hk), r0 = cw * 16, c0 = lane * 4;
  float* qn = sc;              // [D]
  float* kn = qn + GDN_D;      // [D]
  float* gates = kn + GDN_D;   // decay, beta
  float* red = gates + 4;      // [NCW][D]
  const long long slot = g.slots[0];
  const bool has = g.has[0] != 0;
  float* S = g.state + ((size_t)slot * g.hv + h) * GDN_D * GDN_D;
  const float* rows = (r0 < 64 ? sa : sb) + (r0 % 64) * GDN_D + c0;  // this thread's 16 rows (in one piece)
  consumers_sync(mega::CT);  // both warpgroups are past their chunks: xs is free, and every earlier phase of the
  // state's slots is complete, so each thread's parity wait below is on the current phase (not one ahead)
  ring_wait(fa, (k0 / NS) & 1, WATCH_FULL, k0);
  ring_wait(fb, ((k0 + 1) / NS) & 1, WATCH_FULL, k0 + 1);
  if (threadIdx.x == 0) wait_at_least(g.count + h, GDN_ROWS, 1);
  consumers_sync(mega::CT);
  if (cw < 2) {  // warp 0: q, warp 1: k
    const __nv_bfloat16* src = y + (cw == 0 ? kh : g.hk + kh) * GDN_D;
    float v[4], ss = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = bf16_at(src, lane + 32 * j), ss += v[j] * v[j];
    const float r = rsqrtf(mega::warp_sum(ss) + 1e-6f);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      (cw == 0 ? qn : kn)[lane + 32 * j] = cw == 0 ? v[j] * r * 0.08838834764831845f : v[j] * r;
  } else if (cw == 2 && lane == 0) {
    const float a = bf16_at(y, g.a_off + h) + gdn_param(g.dt_bias, h, g.gate_f32);
    const float sp = a > 20.f ? a : logf(1.f + __expf(a));
    gates[0] = __expf(-__expf(gdn_param(g.a_log, h, g.gate_f32)) * sp);
    gates[1] = __bfloat162float(__float2bfloat16_rn(tl_div(1.f, 1.f + __expf(-bf16_at(y, g.b_off + h)))));
  }
  float v[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) v[c] = bf16_at(y, (2 * g.hk + h) * GDN_D + c0 + c);
  consumers_sync(mega::CT);
  const float decay = gates[0], beta = gates[1];
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  float4 kv = zero;
#pragma unroll
  for (int r = 0; r < 16; ++r) {  // S^T k of the decayed state (a zero state where the slot holds none)
    float4 st = has ? *reinterpret_cast<const float4*>(rows + r * GDN_D) : zero;
    const float k = kn[r0 + r];
    st.x *= decay, st.y *= decay, st.z *= decay, st.w *= decay;
    kv.x = fmaf(st.x, k, kv.x), kv.y = fmaf(st.y, k, kv.y), kv.z = fmaf(st.z, k, kv.z), kv.w = fmaf(st.w, k, kv.w);
  }
  *reinterpret_cast<float4*>(red + cw * GDN_D + c0) = kv;
  consumers_sync(mega::CT);
  kv = zero;
#pragma unroll
  for (int w = 0; w < mega::NCW; ++w) {
    const float4 p = *reinterpret_cast<const float4*>(red + w * GDN_D + c0);
    kv.x += p.x, kv.y += p.y, kv.z += p.z, kv.w += p.w;
  }
  const float4 d = make_float4((v[0] - kv.x) * beta, (v[1] - kv.y) * beta, (v[2] - kv.z) * beta, (v[3] - kv.w) * beta);
  float4 o = zero;
#pragma unroll
  for (int r = 0; r < 16; ++r) {  // S = decay S + k delta^T, written back; o = S^T q
    float4 st = has ? *reinterpret_cast<const float4*>(rows + r * GDN_D) : zero;
    const float k = kn[r0 + r], q = qn[r0 + r];
    st.x *= decay, st.y *= decay, st.z *= decay, st.w *= decay;
    st.x = fmaf(k, d.x, st.x), st.y = fmaf(k, d.y, st.y), st.z = fmaf(k, d.z, st.z), st.w = fmaf(k, d.w, st.w);
    o.x = fmaf(st.x, q, o.x), o.y = fmaf(st.y, q, o.y), o.z = fmaf(st.z, q, o.z), o.w = fmaf(st.w, q, o.w);
    __stcg(reinterpret_cast<float4*>(S + (r0 + r) * GDN_D + c0), st);
  }
  consumers_sync(mega::CT);  // every thread has read red's kv
  *reinterpret_cast<float4*>(red + cw * GDN_D + c0) = o;
  consumers_sync(mega::CT);
  if (cw == 0) {
    o = zero;
#pragma unroll
    for (int w = 0; w < mega::NCW; ++w) {
      const float4 p = *reinterpret_cast<const float4*>(red + w * GDN_D + c0);
      o.x += p.x, o.y += p.y, o.z += p.z, o.w += p.w;
    }
    const __nv_bfloat162 lo = __floats2bfloat162_rn(o.x, o.y), hi = __floats2bfloat162_rn(o.z, o.w);
    uint2 bits;
    bits.x = *reinterpret_cast<const uint32_t*>(&lo);
    bits.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(g.out + h * GDN_D + c0) = bits;
    if (lane == 0) g.count[h] = 0u;  // every arrival of this launch is counted: ready for the next
  }
}
}  // namespace
