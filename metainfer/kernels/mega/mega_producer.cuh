// The megakernel's producer warp: the work units, the ring, the L2 lead, the weight streams.
// Part of mega.cu (one translation unit: mega.cu includes the parts in order).
#pragma once

#include "mega_math.cuh"

namespace mega {
// ---- work units, shared by the producer and the consumers (program.py's units(): p[10], p[11]) ------------
// Work units of an instruction (chunks, row blocks, items), dealt to the CTAs round robin, each instruction
// starting where the one before it ended: unit u of an instruction whose units start at `base` (the units of
// the instructions before it) belongs to CTA (base + u) mod gridDim.x. So every CTA gets an equal share of
// the whole step, not the first CTAs one unit more of every instruction. program.py counts them (no
// divisions here): p[10] = units | base << 32, p[11] = the chunking word.
__device__ __forceinline__ int n_units(const Instr& in) { return static_cast<int>(in.p[10] & 0xffffffffu); }
// this CTA's first unit of the instruction (>= n_units: none)
__device__ __forceinline__ int first_unit(const Instr& in) {
  const uint32_t base = static_cast<uint32_t>(in.p[10] >> 32);
  return (int)((blockIdx.x + gridDim.x - base % gridDim.x) % gridDim.x);
}
// GEMV: rows per chunk (a chunk: the rows of one ring slot)
__device__ __forceinline__ int gemv_rpc(const Instr& in) { return static_cast<int>(in.p[11] & 0xffffu); }
// DOWN: row blocks of 16 outputs, each in groups of SLOT / (16 I) experts' pieces
__device__ __forceinline__ int down_per_group(const Instr& in) { return static_cast<int>(in.p[11] & 0xffffu); }
__device__ __forceinline__ int down_groups(const Instr& in) { return static_cast<int>((in.p[11] >> 16) & 0xffffu); }

// (MEGA_WGMMA) a GEMV whose chunks land by TMA for wgmma (wg_dot16): e4m3, K = 2048, 16 rows a chunk, its
// tensor map at p[9] (launch.py: W viewed as [4 rows, 512] bytes, boxes of 128 bytes x 64, 128-byte swizzle)
__device__ __forceinline__ bool wg_gemv(const Instr& in) {
  return WGMMA && in.op == OP_GEMV && in.i[0] == W_E4M3 && in.i[2] == X8_K && gemv_rpc(in) == 16 && in.p[9] != 0;
}

// (MEGA_WGMMA) experts' gate/up chunks by TMA for wgmma: H = 2048, the map at p[9] over w as [4 rows, 512]
// bytes, boxes of 128 bytes x 32 (8 gate rows, then 8 up rows: a chunk's two halves)
__device__ __forceinline__ bool wg_gate_up(const Instr& in) {
  return WGMMA && in.op == OP_GATE_UP && in.i[2] == X8_K && in.p[9] != 0;
}

// ring slot it's block scales (the producer copies a chunk's scale rows there with it)
__device__ __forceinline__ float* slot_scales(const Smem& s, uint32_t it) {
  return s.scales + (it % NSLOTS) * (SCALE_BYTES / 4);
}

// the next ring slot, once free, armed for `bytes` (the caller issues the copies into it) -> its address
__device__ __forceinline__ uint8_t* claim(const Smem& s, uint32_t it, uint32_t bytes, uint32_t& waited) {
  const uint32_t slot = it % NSLOTS, rnd = it / NSLOTS;
  const uint32_t t0 = MEGA_PROF ? cycles() : 0u;
  wait_bar(&s.empty[slot], (rnd & 1) ^ 1, ERR_EMPTY, 0, slot);
  if (it >= s.inflight && s.inflight < NSLOTS) {  // at most `inflight` chunks on their way (see mega_step)
    const uint32_t o = it - s.inflight;
    wait_bar(&s.full[o % NSLOTS], (o / NSLOTS) & 1, ERR_FULL, 0, o % NSLOTS);
  }
  if (MEGA_PROF) waited += cycles() - t0;
  mbar_expect_tx(&s.full[slot], bytes);
  return s.ring + slot * SLOT;
}

// The L2 lead (lead > 0): before the producer waits for a routing, it prefetches into L2 this CTA's
// chunks of the GEMV instructions after instruction i (the dense weights the routing does not decide:
// the next layer's projections), up to `lead` bytes, so the DRAM streams through the routing bubble and
// those chunks later load from L2. (The skeleton's v2 measures the idea: experiments/stream_chain.cu.)
__device__ void l2_lead(const Instr* prog, int n_instr, int i, uint32_t lead) {
  uint32_t done = 0;
  for (int j = i + 1; j < n_instr && done < lead; ++j) {
    const Instr& in = prog[j];
    if (in.op != OP_GEMV) continue;
    const int rb = in.i[2] * (in.i[0] == W_BF16 ? 2 : 1), rpc = gemv_rpc(in), n = n_units(in);
    for (int c = first_unit(in); c < n && done < lead; c += gridDim.x) {
      const uint32_t bytes = min(rpc, in.i[1] - c * rpc) * rb;
      l2_prefetch(ptr<const uint8_t>(in.p[0]) + (size_t)c * rpc * rb, bytes);
      done += bytes;
    }
  }
}

__device__ void producer(const Instr* prog, int n_instr, uint32_t tag, uint32_t lead, const Smem& s, int lane) {
  uint32_t it = 0;
  int routed = -1;  // the router instruction whose routing route_p holds
  const int n_cta = gridDim.x;
  const uint64_t pol = l2_policy<MEGA_EVICT_FIRST != 0>();  // the weights' (read once a step)
  for (int i = 0; i < n_instr; ++i) {
    const Instr& in = prog[i];
    const int first = first_unit(in);
    uint32_t waited = 0;  // (the profiling build) cycles waiting for empty slots
    if (lane == 0) s_instr[0] = i;
    if (MEGA_PROF && lane == 0) prof_set(i, PF_P_IN, cycles());
    if (in.op == OP_GATE_UP || in.op == OP_DOWN) {
      if (first >= n_units(in)) continue;  // none of its units here
      if (routed != in.i[4]) {
        const uint32_t t0 = MEGA_PROF ? cycles() : 0u;
        if (lead && lane == 0) l2_lead(prog, n_instr, i, lead);
        __syncwarp();
        route_warp(Source(prog, in.i[4], 0), in.i[0], in.i[3], tag, s.route_p, lane, i);
        routed = in.i[4];
        if (MEGA_PROF && lane == 0) prof_set(i, PF_P_ROUTE, cycles() - t0);
      }
    }
    if (lane != 0) continue;
    if (in.op == OP_GEMV) {
      const int rb = in.i[2] * (in.i[0] == W_BF16 ? 2 : 1), rpc = gemv_rpc(in), n = n_units(in);
      const uint32_t sb = in.i[0] == W_E4M3 ? in.i[2] / 128 * 4 : 0u;  // the chunk's scale row (one 128-row block)
      const bool tma = wg_gemv(in);
      for (int c = first; c < n; c += n_cta, ++it) {
        uint64_t* bar = &s.full[it % NSLOTS];
        if (tma) {  // 4 boxes of [64 view rows][128 B] (a last chunk's rows past W: zeros, still counted)
          uint8_t* dst = claim(s, it, SLOT + sb, waited);
          for (int kb = 0; kb < 4; ++kb) tma_2d(dst + kb * 8192, ptr<const void>(in.p[9]), kb * 128, c * 64, bar, pol);
        } else {
          const uint32_t bytes = min(rpc, in.i[1] - c * rpc) * rb;
          bulk_load(claim(s, it, bytes + sb, waited), ptr<const uint8_t>(in.p[0]) + (size_t)c * rpc * rb, bytes, bar,
                    pol);
        }
        if (sb) bulk_load(slot_scales(s, it), ptr<const uint8_t>(in.p[1]) + (size_t)(c * rpc / 128) * sb, sb, bar, pol);
      }
    } else if (in.op == OP_GATE_UP) {
      const int I = in.i[1], H = in.i[2], nb = I / 8, n = n_units(in);
      const uint32_t sb = H / 128 * 4;  // one scale row of the gate rows, one of the up rows
      for (int c = first; c < n; c += n_cta, ++it) {  // 8 gate rows, then the 8 up rows beside them
        const int j = c / nb, b = c % nb, e = s.route_p[j];
        const uint8_t* w = ptr<const uint8_t>(in.p[0]) + ((size_t)e * 2 * I + 8 * b) * H;
        const uint8_t* ws = ptr<const uint8_t>(in.p[1]) + (size_t)e * (2 * I / 128) * sb;
        uint64_t* bar = &s.full[it % NSLOTS];
        uint8_t* dst = claim(s, it, 16 * H + 2 * sb, waited);
        if (wg_gate_up(in)) {  // per K block: the gate rows' 32 view rows, then the up rows'
          const int vg = (e * 2 * I + 8 * b) * 4, vu = vg + I * 4;
          for (int kb = 0; kb < 4; ++kb) {
            tma_2d(dst + kb * 8192, ptr<const void>(in.p[9]), kb * 128, vg, bar, pol);
            tma_2d(dst + kb * 8192 + 4096, ptr<const void>(in.p[9]), kb * 128, vu, bar, pol);
          }
        } else {
          bulk_load(dst, w, 8 * H, bar, pol);
          bulk_load(dst + 8 * H, w + (size_t)I * H, 8 * H, bar, pol);
        }
        bulk_load(slot_scales(s, it), ws + (size_t)(8 * b / 128) * sb, sb, bar, pol);
        bulk_load(slot_scales(s, it) + sb / 4, ws + (size_t)((I + 8 * b) / 128) * sb, sb, bar, pol);
      }
    } else if (in.op == OP_DOWN) {
      const int I = in.i[1], H = in.i[2], slots = in.i[3] + 1, per = down_per_group(in);
      for (int rb = first; rb < H / 16; rb += n_cta)
        for (int g = 0; g < down_groups(in); ++g, ++it) {  // the 16 rows of each slot's expert, slot order
          const int n = min(per, slots - g * per);
          const uint32_t sb = I / 128 * 4;  // each piece's scale row
          uint64_t* bar = &s.full[it % NSLOTS];
          uint8_t* dst = claim(s, it, n * (16 * I + sb), waited);
          for (int j = 0; j < n; ++j) {
            const size_t e = s.route_p[g * per + j];
            bulk_load(dst + j * 16 * I, ptr<const uint8_t>(in.p[0]) + (e * H + rb * 16) * I, 16 * I, bar, pol);
            bulk_load(slot_scales(s, it) + j * sb / 4,
                      ptr<const uint8_t>(in.p[1]) + (e * (H / 128) + rb * 16 / 128) * sb, sb, bar, pol);
          }
        }
    }
    if (MEGA_PROF) prof_set(i, PF_P_EMPTY, waited);
  }
}
}  // namespace mega
