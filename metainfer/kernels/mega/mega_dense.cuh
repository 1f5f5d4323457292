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
  int first;  // this CTA's first unit of the current instruction (first_unit)
  uint32_t waited = 0, chunks = 0;  // (the profiling build) this instruction's cycles waiting for chunks, chunks
};
// (the profiling build) consumer thread 0 marks x staged
__device__ __forceinline__ void prof_x_ready(const Ctx& c) {
  if (MEGA_PROF && c.ct == 0) prof_set(s_instr[1], PF_C_X, cycles());
}

// whether an instruction's e4m3 dots run on tile_mma (16-row tiles, K <= 2048)
__device__ __forceinline__ bool mma_path(const Instr& in) {
  return MMA && (in.op == OP_GATE_UP || in.op == OP_DOWN || (in.i[0] == W_E4M3 && in.i[2] <= 2048));
}

__device__ __forceinline__ const uint8_t* next_chunk(Ctx& c) {
  const uint32_t slot = c.it % NSLOTS, rnd = c.it / NSLOTS;
  const uint32_t t0 = MEGA_PROF ? cycles() : 0u;
  wait_bar(&c.s.full[slot], rnd & 1, ERR_FULL, 1, slot);
  if (MEGA_PROF) c.waited += cycles() - t0, ++c.chunks;
  return c.s.ring + slot * SLOT;
}
__device__ __forceinline__ void release_chunk(Ctx& c) {
  __syncwarp();
  if (c.lane == 0) mbar_arrive(&c.s.empty[c.it % NSLOTS]);
  ++c.it;
}

// the state slot's index from conv_slot's word (< 0 where the sequence has no state yet: -slot - 1)
__device__ __forceinline__ long long conv_index(long long slot) { return slot < 0 ? -slot - 1 : slot; }

// The DeltaNet decode conv + SiLU of a GEMV row < nconv (EPI_CONV): its state and weights loaded ahead of the
// row's dot (issue), then the conv of the dot's value with them, the state shifted ([s0, s1, s2] -> [s1, s2, y]).
struct ConvRow {
  float p0 = 0.f, p1 = 0.f, p2 = 0.f, w0 = 0.f, w1 = 0.f, w2 = 0.f, w3 = 0.f;
  __nv_bfloat16* st = nullptr;
  // slot: the step's state slot (< 0: no state yet, zeros)
  __device__ void issue(const Instr& in, int row, long long slot) {
    if (in.i[10] != EPI_CONV || row >= in.i[11]) return;
    const int C = in.i[11];
    st = ptr<__nv_bfloat16>(in.p[6]) + conv_index(slot) * 3 * C + row;
    const __nv_bfloat16* cwt = ptr<const __nv_bfloat16>(in.p[7]) + (size_t)row * 4;
    const uint2 wv = *reinterpret_cast<const uint2*>(cwt);  // the row's 4 taps (8 bytes)
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wv.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wv.y));
    w0 = a.x, w1 = a.y, w2 = b.x, w3 = b.y;
    if (slot >= 0) p0 = bf_at(st, 0), p1 = bf_at(st, C), p2 = bf_at(st, 2 * C);
  }
  __device__ float apply(const Instr& in, float v) const {
    if (st == nullptr) return v;
    const int C = in.i[11];
    const float y = bf(v);
    float cv = y * w3;
    cv += p0 * w0;
    cv += p1 * w1;
    cv += p2 * w2;
    st[0] = __float2bfloat16_rn(p1);
    st[C] = __float2bfloat16_rn(p2);
    st[2 * C] = __float2bfloat16_rn(y);
    cv = bf(cv);
    return cv / (1.f + __expf(-cv));
  }
};

// a GEMV row's output (one thread): the conv epilogue where the row has one, the plain copy, the tagged word
__device__ void gemv_store(const Instr& in, int row, float v, const ConvRow& conv, uint32_t tag) {
  const int out = in.i[4];
  v = conv.apply(in, v);
  if (out == OUT_PLAIN_F32) ptr<float>(in.p[5])[row] = v;
  store_word(ptr<uint64_t>(in.p[4]), row, v, out == OUT_BF16 ? OUT_BF16 : OUT_F32, tag);
}

// the step's state slot for ConvRow::issue: slot, or -slot - 1 where the sequence has no state yet
__device__ __forceinline__ long long conv_slot(const Instr& in) {
  if (in.i[10] != EPI_CONV) return 0;
  const long long* step = ptr<const long long>(in.p[8]);
  const long long slot = step[STEP_STATE_SLOT];
  return step[STEP_HAS_STATE] != 0 ? slot : -slot - 1;
}

// (EPI_CONV) the conv taps and the state rows of this CTA's chunks prefetched into L2 while x is polled, 4
// threads per chunk: the state is the last step's (back in DRAM by now), and ConvRow::issue loads it only a
// row's dot ahead of its use
__device__ void conv_prefetch(const Ctx& c, const Instr& in, long long slot) {
  if (in.i[10] != EPI_CONV) return;
  const int C = in.i[11], rpc = gemv_rpc(in), ch = c.first + (c.ct / 4) * (int)gridDim.x, part = c.ct % 4;
  if (ch * rpc >= C) return;  // (C <= rows: past this CTA's chunks too)
  const int rows = min(rpc, C - ch * rpc);
  const uint8_t* p = part == 0 ? ptr<const uint8_t>(in.p[7]) + (size_t)ch * rpc * 8  // taps: 4 bf16 a row
                               : ptr<const uint8_t>(in.p[6]) +
                                     (conv_index(slot) * 3 * C + (long long)(part - 1) * C + ch * rpc) * 2;
  const uint32_t bytes = (part == 0 ? rows * 8 : rows * 2) & ~15u;
  if ((part == 0 || slot >= 0) && bytes > 0 && (reinterpret_cast<uintptr_t>(p) & 15) == 0) l2_prefetch(p, bytes);
}

__device__ void op_gemv(Ctx& c, const Instr& in) {
  const int n = n_units(in);
  if (c.first >= n) return;
  const int wtype = in.i[0], rows_all = in.i[1], K = in.i[2], pro = in.i[3];
  consumers_sync(CT);  // every warp is done with the previous instruction's x and scratch
  const long long slot = conv_slot(in);  // (its loads in flight while x is polled)
  conv_prefetch(c, in, slot);
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
  prof_x_ready(c);
  const int rb = K * (wtype == W_BF16 ? 2 : 1), rpc = gemv_rpc(in);
  if (wg_gemv(in)) {  // the warpgroups take alternate chunks; lanes 0 and 16 of each warp store 2 rows each
    stage_x8(c.s.xs, x8_of(c.s), x8f_of(c.s), c.cw, c.lane);
    consumers_sync(CT);
    const int wg = c.cw / 4, r0 = 4 * (c.cw % 4) + c.lane / 16;  // this lane's rows r0, r0 + 2
    const bool st = (c.lane & 15) == 0;
    const uint32_t it0 = c.it;
    int j = 0;
    for (int ch = c.first; ch < n; ch += gridDim.x, ++j) {
      if ((j & 1) != wg) continue;
      c.it = it0 + j;
      const uint8_t* chunk = next_chunk(c);
      const int rows = min(rpc, rows_all - ch * rpc), row = ch * rpc + r0;
      ConvRow cv0, cv1;
      if (st && r0 < rows) cv0.issue(in, row, slot);
      if (st && r0 + 2 < rows) cv1.issue(in, row + 2, slot);
      __syncwarp();
      const float2 v = wg_dot16(chunk, slot_scales(c.s, c.it), x8_of(c.s), x8f_of(c.s), c.lane);
      __syncwarp();
      if (c.lane == 0) mbar_arrive_n(&c.s.empty[c.it % NSLOTS], NCW / 4);  // (the slot's 4 warps)
      if (st && r0 < rows) gemv_store(in, row, v.x, cv0, c.tag);
      if (st && r0 + 2 < rows) gemv_store(in, row + 2, v.y, cv1, c.tag);
    }
    c.it = it0 + j;
    return;
  }
  if (mma_path(in)) {  // 16-row tiles on the tensor cores; lane r < 16 of warp (tile % NCW) stores row r
    stage_f16(c.s, K, c.ct);
    const __half* xh = xh_of(c.s, false);
    int buf = 0;
    for (int ch = c.first; ch < n; ch += gridDim.x) {
      const uint8_t* chunk = next_chunk(c);
      const int rows = min(rpc, rows_all - ch * rpc);
      for (int t = 0; t * 16 < rows; ++t) {
        const int row0 = ch * rpc + t * 16;
        const bool mine = c.cw == t % NCW && c.lane < 16 && t * 16 + c.lane < rows;
        ConvRow conv;
        if (mine) conv.issue(in, row0 + c.lane, slot);
        const float* wsr = slot_scales(c.s, c.it);  // the chunk's rows are in one 128-row block
        const float v = tile_sum(tile_mma(chunk + (size_t)t * 16 * K, K, xh, wsr, wsr, c.cw, c.lane), c.s.sc + 64, buf,
                                 c.cw, c.lane);
        if (mine) gemv_store(in, row0 + c.lane, v, conv, c.tag);
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
      const float* ws_row = slot_scales(c.s, c.it);  // e4m3: the chunk's rows are in one 128-row block
      float v, v_next = 0.f;
      const bool pair = wtype == W_E4M3 && r + NCW < rows;  // this warp's next row too, sharing x's loads
      ConvRow conv;  // lane 0 stores row, lane 1 the pair's second row
      if (c.lane == 0 || (pair && c.lane == 1)) conv.issue(in, row + c.lane * NCW, slot);
      if (pair) {
        const float2 vv = row_dot2(chunk + (size_t)r * rb, chunk + (size_t)(r + NCW) * rb, K, ws_row, ws_row,
                                   c.s.xs, c.lane);
        v = vv.x;
        v_next = vv.y;
      } else {
        v = row_dot(chunk + (size_t)r * rb, wtype, K, ws_row, c.s.xs, c.lane);
      }
      if (c.lane == 0) gemv_store(in, row, v, conv, c.tag);
      if (pair) {
        if (c.lane == 1) gemv_store(in, row + NCW, v_next, conv, c.tag);
        r += NCW;
      }
    }
    release_chunk(c);
  }
}

__device__ void op_gate_up(Ctx& c, const Instr& in) {
  const int n = n_units(in);
  if (c.first >= n) return;
  const int I = in.i[1], H = in.i[2], nb = I / 8, kb = H / 128;
  consumers_sync(CT);  // (no routing here: the producer picked the experts' rows; chunk c is slot c / nb's)
  const Source add(c.prog, in.i[8], in.i[9]);
  stage_norm(XIn(c.prog, in, 5, H), &add, ptr<const __nv_bfloat16>(in.p[2]), in.f[0], H, c.tag, c.s, c.ct, c.cw,
             c.lane);
  consumers_sync(CT);
  prof_x_ready(c);
  if (wg_gate_up(in)) {  // the warpgroups take alternate chunks: warps 0, 1 hold gate rows 0-7, warps 2, 3 up rows
    stage_x8(c.s.xs, x8_of(c.s), x8f_of(c.s), c.cw, c.lane);
    consumers_sync(CT);
    const int wg = c.cw / 4, w4 = c.cw % 4, r = 4 * (w4 % 2) + c.lane / 16;  // this lane's rows r, r + 2 of 8
    const bool st = (c.lane & 15) == 0;
    float* ups = c.s.sc + 64 + wg * 16;  // [2][8]: the up rows' dots, by chunk parity (a barrier between uses)
    const uint32_t it0 = c.it;
    int j = 0, par = 0;
    for (int ch = c.first; ch < n; ch += gridDim.x, ++j) {
      if ((j & 1) != wg) continue;
      c.it = it0 + j;
      const uint8_t* chunk = next_chunk(c);
      const int sj = ch / nb, b = ch % nb;
      __syncwarp();
      const float2 v = wg_dot16(chunk, slot_scales(c.s, c.it) + (w4 >= 2 ? kb : 0), x8_of(c.s), x8f_of(c.s),
                                      c.lane);
      __syncwarp();
      if (c.lane == 0) mbar_arrive_n(&c.s.empty[c.it % NSLOTS], NCW / 4);
      float* u = ups + par * 8;
      if (w4 >= 2 && st) u[r] = v.x, u[r + 2] = v.y;
      warpgroup_sync(wg);
      if (w4 < 2 && st) {
        uint64_t* y = ptr<uint64_t>(in.p[4]) + sj * I + 8 * b;
        store_word(y, r, v.x / (1.f + __expf(-v.x)) * u[r], OUT_BF16, c.tag);
        store_word(y, r + 2, v.y / (1.f + __expf(-v.y)) * u[r + 2], OUT_BF16, c.tag);
      }
      par ^= 1;
    }
    c.it = it0 + j;
    return;
  }
  if constexpr (MMA) {  // each chunk one 16-row tile: gate rows 0-7, up rows 8-15; warp 0's lanes 0-7 store
    stage_f16(c.s, H, c.ct);
    const __half* xh = xh_of(c.s, false);
    int buf = 0;
    for (int ch = c.first; ch < n; ch += gridDim.x) {
      const uint8_t* chunk = next_chunk(c);
      const int j = ch / nb, b = ch % nb;
      const float* ws_g = slot_scales(c.s, c.it);  // the gate rows' scale row, then the up rows'
      const float* ws_u = ws_g + kb;
      const float v = tile_sum(tile_mma(chunk, H, xh, ws_g, ws_u, c.cw, c.lane), c.s.sc + 64, buf, c.cw, c.lane);
      const float u = __shfl_down_sync(0xffffffffu, v, 8);  // lane r < 8: its up row's dot
      if (c.cw == 0 && c.lane < 8)
        store_word(ptr<uint64_t>(in.p[4]), j * I + 8 * b + c.lane, v / (1.f + __expf(-v)) * u, OUT_BF16, c.tag);
      release_chunk(c);
    }
  } else {
    for (int ch = c.first; ch < n; ch += gridDim.x) {
      const uint8_t* chunk = next_chunk(c);
      const int j = ch / nb, b = ch % nb, rg = 8 * b + c.cw;  // this warp's gate row (and up row I + rg) of slot j
      const float* ws_g = slot_scales(c.s, c.it);  // the gate rows' scale row, then the up rows'
      const float2 gu = row_dot2(chunk + (size_t)c.cw * H, chunk + (size_t)(8 + c.cw) * H, H, ws_g, ws_g + kb, c.s.xs,
                                 c.lane);
      if (c.lane == 0)
        store_word(ptr<uint64_t>(in.p[4]), j * I + rg, gu.x / (1.f + __expf(-gu.x)) * gu.y, OUT_BF16, c.tag);
      release_chunk(c);
    }
  }
}

// The routing weights come from the producer's routing (route_p): it wrote them before arming this instruction's
// first chunk, whose barrier the consumers have waited for when they read them; and it cannot route the next
// layer before this CTA's outputs here are stored (the next router's logits depend on them).
__device__ void op_down(Ctx& c, const Instr& in) {
  const int I = in.i[1], H = in.i[2], slots = in.i[3] + 1, per = down_per_group(in), kb = I / 128;
  if (c.first >= H / 16) return;
  consumers_sync(CT);
  const XIn act(c.prog, in, 8, slots * I, X_SRC), res(c.prog, in, 5, H);
  const Source radd(c.prog, in.i[10], in.i[11]);
  // the residual bf16(res + radd) of the first row block's 16 rows (ready: earlier outputs) into rsm, its words
  // loaded before the activations are polled
  float* rsm = c.s.sc + 2304;
  uint64_t w_res = 0, w_add = 0;
  if (c.ct < 16) {
    if (res.kind == X_SRC) w_res = ld_relaxed_u64(res.src.y + c.first * 16 + c.ct);
    w_add = ld_relaxed_u64(radd.y + c.first * 16 + c.ct);
  }
  if constexpr (MMA) {
    stage_raw<FETCH_GROUP, true>(act, nullptr, slots * I, nullptr, c.tag, c.ct, xh_of(c.s, true));  // into f16
  } else {
    stage_raw(act, nullptr, slots * I, c.s.xs, c.tag, c.ct);
  }
  if (c.ct < 16) {
    const int row = c.first * 16 + c.ct;
    const float a = res.kind == X_SRC ? word_value(res.src.wait(row, w_res, c.tag), res.src.kind) : res(row, c.tag);
    rsm[c.ct] = bf(a + word_value(radd.wait(row, w_add, c.tag), radd.kind));
  }
  consumers_sync(CT);
  prof_x_ready(c);
  // a row's residual: rsm for the first row block, else polled here
  auto residual = [&](int rb, int row) {
    return rb == c.first ? rsm[row % 16] : bf(res(row, c.tag) + radd(row, c.tag));
  };
  const float* wts = reinterpret_cast<const float*>(c.s.route_p) + 16;  // (read after a chunk's wait)
  if constexpr (MMA) {  // each piece one 16-row tile; warp 0's lane r < 16 keeps row r's weighted sum
    const __half* xh = xh_of(c.s, true);
    int buf = 0;
    for (int rb = c.first; rb < H / 16; rb += gridDim.x) {
      const int row = rb * 16 + c.lane;
      float acc = 0.f;
      for (int g = 0; g < down_groups(in); ++g) {
        const uint8_t* chunk = next_chunk(c);
        for (int j = g * per; j < min(slots, g * per + per); ++j) {
          const float* wsr = slot_scales(c.s, c.it) + (j - g * per) * kb;  // piece j's scale row
          const float y = tile_sum(tile_mma(chunk + (size_t)(j - g * per) * 16 * I, I, xh + j * I, wsr, wsr, c.cw,
                                            c.lane), c.s.sc + 64, buf, c.cw, c.lane);
          acc = fmaf(wts[j], y, acc);
        }
        release_chunk(c);
      }
      if (c.cw == 0 && c.lane < 16)
        store_word(ptr<uint64_t>(in.p[4]), row, bf(acc) + residual(rb, row), OUT_BF16, c.tag);
    }
  } else {
    for (int rb = c.first; rb < H / 16; rb += gridDim.x) {
      const int row = rb * 16 + c.cw + 8 * c.lane;  // (lanes 0 and 1: rows cw and cw + 8)
      float acc0 = 0.f, acc1 = 0.f;  // rows rb * 16 + cw and + 8 (every lane holds them)
      for (int g = 0; g < down_groups(in); ++g) {
        const uint8_t* chunk = next_chunk(c);
        for (int j = g * per; j < min(slots, g * per + per); ++j) {
          const uint8_t* piece = chunk + (size_t)(j - g * per) * 16 * I;
          const float* wsr = slot_scales(c.s, c.it) + (j - g * per) * kb;  // piece j's scale row (its 16 rows)
          const float2 y = row_dot2(piece + (size_t)c.cw * I, piece + (size_t)(8 + c.cw) * I, I, wsr, wsr,
                                    c.s.xs + j * I, c.lane);
          acc0 = fmaf(wts[j], y.x, acc0);
          acc1 = fmaf(wts[j], y.y, acc1);
        }
        release_chunk(c);
      }
      if (c.lane < 2)
        store_word(ptr<uint64_t>(in.p[4]), row, bf(c.lane ? acc1 : acc0) + residual(rb, row), OUT_BF16, c.tag);
    }
  }
}
}  // namespace mega
