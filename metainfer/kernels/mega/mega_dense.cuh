// The megakernel's consumers of streamed weights: GEMV, the experts' GateUp and Down.
// Part of mega.cu (one translation unit: mega.cu includes the parts in order).
#pragma once

#include "mega_producer.cuh"

namespace mega {
// ---- consumers ---------------------------------------------------------------------------------------
struct Ctx {
  const Instr* prog;
  uint32_t tag;
  Smem s;
  int ct, cw, lane;
  uint32_t it;
  int routed;
  int first;  // this CTA's first unit of the current instruction (first_unit)
  int mma;    // the tensor-core consumers (tile_mma) where an instruction allows them
};

// whether an instruction's e4m3 dots run on tile_mma (16-row tiles, K <= 2048)
__device__ __forceinline__ bool mma_path(const Ctx& c, const Instr& in) {
  return c.mma && (in.op == OP_GATE_UP || in.op == OP_DOWN || (in.i[0] == W_E4M3 && in.i[2] <= 2048));
}

__device__ __forceinline__ const uint8_t* next_chunk(Ctx& c) {
  const uint32_t slot = c.it % NSLOTS, rnd = c.it / NSLOTS;
  wait_bar(&c.s.full[slot], rnd & 1, ERR_FULL, 1, slot);
  return c.s.ring + slot * SLOT;
}
__device__ __forceinline__ void release_chunk(Ctx& c) {
  __syncwarp();
  if (c.lane == 0) mbar_arrive(&c.s.empty[c.it % NSLOTS]);
  ++c.it;
}

__device__ void route_consumers(Ctx& c, const Instr& in) {
  if (c.routed == in.i[4]) return;
  consumers_sync(CT);  // nobody still reads the previous routing
  if (c.cw == 0) route_warp(Source(c.prog, in.i[4], 0), in.i[0], in.i[3], c.tag, c.s.route_c, c.lane);
  consumers_sync(CT);
  c.routed = in.i[4];
}

// a GEMV row's output (one thread): the DeltaNet decode conv + SiLU on rows < nconv (their conv state
// shifted: [s0, s1, s2] -> [s1, s2, y]), the plain copy, the tagged word
__device__ void gemv_store(const Instr& in, int row, float v, const long long* step, uint32_t tag) {
  const int out = in.i[4];
  if (in.i[10] == EPI_CONV && row < in.i[11]) {
    const int C = in.i[11];
    const long long slot = step[STEP_STATE_SLOT];
    const bool has = step[STEP_HAS_STATE] != 0;
    __nv_bfloat16* st = ptr<__nv_bfloat16>(in.p[6]) + slot * 3 * C + row;
    const __nv_bfloat16* cwt = ptr<const __nv_bfloat16>(in.p[7]) + (size_t)row * 4;
    const float y = bf(v), p0 = has ? bf_at(st, 0) : 0.f, p1 = has ? bf_at(st, C) : 0.f,
                p2 = has ? bf_at(st, 2 * C) : 0.f;
    float cv = y * bf_at(cwt, 3);
    cv += p0 * bf_at(cwt, 0);
    cv += p1 * bf_at(cwt, 1);
    cv += p2 * bf_at(cwt, 2);
    st[0] = __float2bfloat16_rn(p1);
    st[C] = __float2bfloat16_rn(p2);
    st[2 * C] = __float2bfloat16_rn(y);
    cv = bf(cv);
    v = cv / (1.f + __expf(-cv));
  }
  if (out == OUT_PLAIN_F32) ptr<float>(in.p[5])[row] = v;
  store_word(ptr<uint64_t>(in.p[4]), row, v, out == OUT_BF16 ? OUT_BF16 : OUT_F32, tag);
}

__device__ void op_gemv(Ctx& c, const Instr& in) {
  const int n = n_chunks_of(in);
  if (c.first >= n) return;
  const int wtype = in.i[0], rows_all = in.i[1], K = in.i[2], pro = in.i[3];
  consumers_sync(CT);  // every warp is done with the previous instruction's x and scratch
  const XIn x(c.prog, in, 5, K);
  if (pro == PRO_NONE) {
    stage_raw(x, nullptr, K, c.s.xs, c.tag, c.ct);
  } else if (pro == PRO_GATED_NORM) {
    stage_gated(x, Source(c.prog, in.i[8], in.i[9]), ptr<const __nv_bfloat16>(in.p[2]), in.f[0], K, in.i[11], c.tag,
                c.s, c.ct, c.cw, c.lane);
  } else {
    const Source add(c.prog, in.i[8], in.i[9]);
    stage_norm(x, pro == PRO_ADD_RMSNORM ? &add : nullptr, ptr<const __nv_bfloat16>(in.p[2]), in.f[0], K, c.tag, c.s,
               c.ct, c.cw, c.lane);
  }
  consumers_sync(CT);
  const int rb = K * (wtype == W_BF16 ? 2 : 1), rpc = gemv_rpc(in), kb = K / 128;
  const long long* step = ptr<const long long>(in.p[8]);
  if (mma_path(c, in)) {  // 16-row tiles on the tensor cores; lane r < 16 of warp (tile % NCW) stores row r
    stage_f16(c.s, K, c.ct);
    const __half* xh = xh_of(c.s, false);
    int buf = 0;
    for (int ch = c.first; ch < n; ch += gridDim.x) {
      const uint8_t* chunk = next_chunk(c);
      const int rows = min(rpc, rows_all - ch * rpc);
      for (int t = 0; t * 16 < rows; ++t) {
        const int row0 = ch * rpc + t * 16;
        const float* wsr = ptr<const float>(in.p[1]) + (size_t)(row0 / 128) * kb;
        const float v = tile_sum(tile_mma(chunk + (size_t)t * 16 * K, K, xh, wsr, wsr, c.cw, c.lane), c.s.sc + 64, buf,
                                 c.cw, c.lane);
        if (c.cw == t % NCW && c.lane < 16 && t * 16 + c.lane < rows) gemv_store(in, row0 + c.lane, v, step, c.tag);
      }
      release_chunk(c);
    }
    return;
  }
  for (int ch = c.first; ch < n; ch += gridDim.x) {
    const uint8_t* chunk = next_chunk(c);
    const int rows = min(rpc, rows_all - ch * rpc);
    for (int r = c.cw; r < rows; r += NCW) {
      const int row = ch * rpc + r;
      const float* ws_row = wtype == W_E4M3 ? ptr<const float>(in.p[1]) + (size_t)(row / 128) * kb : nullptr;
      float v, v_next = 0.f;
      const bool pair = wtype == W_E4M3 && r + NCW < rows;  // this warp's next row too, sharing x's loads
      if (pair) {
        const float* ws_next = ptr<const float>(in.p[1]) + (size_t)((row + NCW) / 128) * kb;
        const float2 vv = row_dot2(chunk + (size_t)r * rb, chunk + (size_t)(r + NCW) * rb, K, ws_row, ws_next,
                                   c.s.xs, c.lane);
        v = vv.x;
        v_next = vv.y;
      } else {
        v = row_dot(chunk + (size_t)r * rb, wtype, K, ws_row, c.s.xs, c.lane);
      }
      if (c.lane == 0) gemv_store(in, row, v, step, c.tag);
      if (pair) {
        if (c.lane == 0) gemv_store(in, row + NCW, v_next, step, c.tag);
        r += NCW;
      }
    }
    release_chunk(c);
  }
}

__device__ void op_gate_up(Ctx& c, const Instr& in) {
  const int n = n_chunks_of(in);
  if (c.first >= n) return;
  const int I = in.i[1], H = in.i[2], nb = I / 8, kb = H / 128;
  route_consumers(c, in);
  consumers_sync(CT);
  const Source add(c.prog, in.i[8], in.i[9]);
  stage_norm(XIn(c.prog, in, 5, H), &add, ptr<const __nv_bfloat16>(in.p[2]), in.f[0], H, c.tag, c.s, c.ct, c.cw,
             c.lane);
  consumers_sync(CT);
  const float* ws = ptr<const float>(in.p[1]);
  if (c.mma) {  // each chunk one 16-row tile: gate rows 0-7, up rows 8-15; warp 0's lanes 0-7 store
    stage_f16(c.s, H, c.ct);
    const __half* xh = xh_of(c.s, false);
    int buf = 0;
    for (int ch = c.first; ch < n; ch += gridDim.x) {
      const uint8_t* chunk = next_chunk(c);
      const int j = ch / nb, b = ch % nb, e = c.s.route_c[j];
      const float* wse = ws + (size_t)e * (2 * I / 128) * kb;
      const float* ws_g = wse + ((8 * b) / 128) * kb;
      const float* ws_u = wse + ((I + 8 * b) / 128) * kb;
      const float v = tile_sum(tile_mma(chunk, H, xh, ws_g, ws_u, c.cw, c.lane), c.s.sc + 64, buf, c.cw, c.lane);
      const float u = __shfl_down_sync(0xffffffffu, v, 8);  // lane r < 8: its up row's dot
      if (c.cw == 0 && c.lane < 8)
        store_word(ptr<uint64_t>(in.p[4]), j * I + 8 * b + c.lane, v / (1.f + __expf(-v)) * u, OUT_BF16, c.tag);
      release_chunk(c);
    }
    return;
  }
  for (int ch = c.first; ch < n; ch += gridDim.x) {
    const uint8_t* chunk = next_chunk(c);
    const int j = ch / nb, b = ch % nb, e = c.s.route_c[j];
    const int rg = 8 * b + c.cw, ru = I + rg;  // this warp's gate and up rows of expert e
    const float* wse = ws + (size_t)e * (2 * I / 128) * kb;
    const float2 gu = row_dot2(chunk + (size_t)c.cw * H, chunk + (size_t)(8 + c.cw) * H, H, wse + (rg / 128) * kb,
                               wse + (ru / 128) * kb, c.s.xs, c.lane);
    if (c.lane == 0)
      store_word(ptr<uint64_t>(in.p[4]), j * I + rg, gu.x / (1.f + __expf(-gu.x)) * gu.y, OUT_BF16, c.tag);
    release_chunk(c);
  }
}

__device__ void op_down(Ctx& c, const Instr& in) {
  const int I = in.i[1], H = in.i[2], slots = in.i[3] + 1, per = down_per_group(in), kb = I / 128;
  if (c.first >= H / 16) return;
  route_consumers(c, in);
  consumers_sync(CT);
  const XIn act(c.prog, in, 8, slots * I, X_SRC);
  if (c.mma) {  // the activations straight into f16 (no fp32 copy)
    __half* xh = xh_of(c.s, true);
    for (int e = c.ct; e < slots * I; e += CT) xh[e] = __float2half_rn(act(e, c.tag));
  } else {
    stage_raw(act, nullptr, slots * I, c.s.xs, c.tag, c.ct);
  }
  consumers_sync(CT);
  const XIn res(c.prog, in, 5, H);
  const Source radd(c.prog, in.i[10], in.i[11]);
  const float* wts = reinterpret_cast<const float*>(c.s.route_c) + 16;
  const float* ws = ptr<const float>(in.p[1]);
  if (c.mma) {  // each piece one 16-row tile; warp 0's lane r < 16 keeps row r's weighted sum
    const __half* xh = xh_of(c.s, true);
    int buf = 0;
    for (int rb = c.first; rb < H / 16; rb += gridDim.x) {
      float acc = 0.f;
      for (int g = 0; g < down_groups(in); ++g) {
        const uint8_t* chunk = next_chunk(c);
        for (int j = g * per; j < min(slots, g * per + per); ++j) {
          const float* wsr = ws + (size_t)c.s.route_c[j] * (H / 128) * kb + ((rb * 16) / 128) * kb;
          const float y = tile_sum(tile_mma(chunk + (size_t)(j - g * per) * 16 * I, I, xh + j * I, wsr, wsr, c.cw,
                                            c.lane), c.s.sc + 64, buf, c.cw, c.lane);
          acc = fmaf(wts[j], y, acc);
        }
        release_chunk(c);
      }
      if (c.cw == 0 && c.lane < 16) {
        const int row = rb * 16 + c.lane;
        const float r = bf(res(row, c.tag) + radd(row, c.tag));
        store_word(ptr<uint64_t>(in.p[4]), row, bf(acc) + r, OUT_BF16, c.tag);
      }
    }
    return;
  }
  for (int rb = c.first; rb < H / 16; rb += gridDim.x) {
    float acc0 = 0.f, acc1 = 0.f;  // rows rb * 16 + cw and + 8 (every lane holds them)
    for (int g = 0; g < down_groups(in); ++g) {
      const uint8_t* chunk = next_chunk(c);
      for (int j = g * per; j < min(slots, g * per + per); ++j) {
        const uint8_t* piece = chunk + (size_t)(j - g * per) * 16 * I;
        const float* wse = ws + (size_t)c.s.route_c[j] * (H / 128) * kb;
        const int r0 = rb * 16 + c.cw, r1 = r0 + 8;
        const float2 y = row_dot2(piece + (size_t)c.cw * I, piece + (size_t)(8 + c.cw) * I, I, wse + (r0 / 128) * kb,
                                  wse + (r1 / 128) * kb, c.s.xs + j * I, c.lane);
        acc0 = fmaf(wts[j], y.x, acc0);
        acc1 = fmaf(wts[j], y.y, acc1);
      }
      release_chunk(c);
    }
    if (c.lane < 2) {
      const int row = rb * 16 + c.cw + 8 * c.lane;
      const float r = bf(res(row, c.tag) + radd(row, c.tag));
      store_word(ptr<uint64_t>(in.p[4]), row, bf(c.lane ? acc1 : acc0) + r, OUT_BF16, c.tag);
    }
  }
}
}  // namespace mega
