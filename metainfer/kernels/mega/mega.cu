// The batch-1 decode step as one persistent kernel (docs/megakernel.md). A program (built and
// checked by program.py; emulate.py is each instruction's ground truth) runs in one cooperative launch of
// one CTA per SM.
//
// Roles per CTA: warp NCW (the last) is the producer. It walks the program and streams its CTA's chunks of
// every instruction's weights through a ring of NSLOTS shared-memory slots (1-D bulk copies, or 2-D tensor
// copies for wgmma, completing on mbarriers). Dense weights never wait; the experts' wait for the routing,
// which the producer warp recomputes from the router's logits. Warps 0..NCW - 1 (two warpgroups, as wgmma
// needs) are consumers: per instruction they build x in shared memory (sources polled, then the prologue),
// reduce the ring's chunks (on the CUDA cores, on mma.sync in the MEGA_MMA build: launch mma = True, or the
// K = 2048 GEMVs on wgmma in the MEGA_WGMMA build) and store each output; the recurrent-state and attention
// instructions read their state and cache directly.
//
// The parts, in include order: mega_base.cuh (layout, watchdog, polled sources), mega_math.cuh (norms,
// dots, routing), mega_producer.cuh (work units, ring, weight streams), mega_dense.cuh (GEMV, the
// experts), mega_mixers.cuh (DeltaNet state, attention); this file holds the kernel's entry.
//
// Outputs are tagged 64-bit words: tag << 32 | value bits (fp32, or bf16 in the low 16). The tag is the
// step's number (step_tag + 1, read at launch): a consumer polls the data itself, stale words of the last
// step never pass, nothing is reset between steps. The last CTA out advances *step_tag.
//
// Numerics follow the engine's decode kernels: e4m3 (or bf16) weights times x in fp32, each 16-weight
// piece's sum times its 128 x 128 block scale; fp32 sums; bf16 activations rounded where the engine
// rounds them (emulate.py lists each).
//
// Instr fields by op (program.fields writes them):
//   GEMV      i: wtype rows k pro out xkind xidx xoff addidx addoff epi hd|nconv   f: eps
//             p: w ws norm_w xptr y plain conv_state conv_w step
//   GATE_UP   i: E I H top_k logits xkind xidx xoff addidx addoff   f: eps   p: w ws norm_w xptr y - - - step
//   DOWN      i: E I H top_k logits reskind residx resoff actidx actoff radd_idx radd_off
//             p: w ws - resptr y - - - step
//   DELTA     i: hk Hv Dk Dv b_off a_off proj   p: state A_log dt_bias - y - - - step
//   ATTEND    i: hq hkv D rd splits block qkv qkv_off   f: eps scale
//             p: k_cache v_cache q_norm_w k_norm_w y inv_freq block_table - step
//   COMBINE   i: hq D splits parts parts_off qkv qkv_off   p: - - - - y
//   every op  p[10]: units | base << 32, p[11]: the chunking word (program.units; mega_producer.cuh)

#include "mega_mixers.cuh"  // (and, through it, every part)

using namespace mega;

extern "C" __global__ void __launch_bounds__(NT, 1)
    mega_step(const Instr* __restrict__ prog, int n_instr, uint32_t* state, uint32_t lead, uint32_t inflight,
              uint32_t* prof) {
  extern __shared__ __align__(128) uint8_t smem[];
  Smem s;
  s.ring = smem + ((RING_ALIGN - (smem_u32(smem) & (RING_ALIGN - 1))) & (RING_ALIGN - 1));
  s.inflight = inflight >= 1 && inflight < NSLOTS ? inflight : NSLOTS;
  s.scales = reinterpret_cast<float*>(s.ring + NSLOTS * SLOT);
  s.full = reinterpret_cast<uint64_t*>(s.ring + NSLOTS * SLOT + NSLOTS * SCALE_BYTES);
  s.empty = s.full + NSLOTS;
  s.xs = reinterpret_cast<float*>(s.empty + NSLOTS);
  s.sc = s.xs + KMAX;
  s.route_p = reinterpret_cast<int*>(s.sc + SCRATCH);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t* step_tag = state;  // state: [0] the last step's tag, [1] CTAs finished, [2..5] the watchdog
  uint32_t* done = state + 1;
  const uint32_t tag = *reinterpret_cast<volatile uint32_t*>(step_tag) + 1u;
  const uint64_t t_in = MEGA_PROF ? global_ns() : 0ull;
  if (threadIdx.x == 0) {
    g_err = state + 2;
    g_prof = prof;
    g_nin = n_instr;
    s_instr[0] = s_instr[1] = -1;
    for (int i = 0; i < NSLOTS; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], NCW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == NCW) {
    producer(prog, n_instr, tag, lead, s, lane);
  } else {
    Ctx c{prog, tag, s, (int)threadIdx.x, warp, lane, 0u, 0};
    for (int i = 0; i < n_instr; ++i) {
      const Instr& in = prog[i];
      c.first = first_unit(in);
      if (threadIdx.x == 0) s_instr[1] = i;  // (read only by a thread that gives up; and the profile)
      if (MEGA_PROF && threadIdx.x == 0) {
        prof_set(i, PF_LAT, probe_latency());
        prof_set(i, PF_C_IN, cycles()), c.waited = c.chunks = 0;
      }
      switch (in.op) {
        case OP_GEMV: op_gemv(c, in); break;
        case OP_GATE_UP: op_gate_up(c, in); break;
        case OP_DOWN: op_down(c, in); break;
        case OP_DELTA: op_delta(c, in); break;
        case OP_ATTEND: op_attend(c, in); break;
        case OP_COMBINE: op_combine(c, in); break;
        default: break;
      }
      if (MEGA_PROF && threadIdx.x == 0) {
        prof_set(i, PF_C_OUT, cycles());
        prof_set(i, PF_C_WAIT, c.waited);
        prof_set(i, PF_CHUNKS, c.chunks);
      }
    }
  }
  __syncthreads();
  if (MEGA_PROF && threadIdx.x == 0) {  // globaltimer (ns) at entry and exit: the CTAs' spans line up
    uint32_t* t = g_prof + (size_t)gridDim.x * n_instr * PF_N + blockIdx.x * 4;
    const uint64_t t_out = global_ns();
    t[0] = (uint32_t)t_in, t[1] = (uint32_t)(t_in >> 32), t[2] = (uint32_t)t_out, t[3] = (uint32_t)(t_out >> 32);
  }
  if (threadIdx.x == 0) {  // the last CTA out advances the step's tag for the next launch
    __threadfence();
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      *done = 0;
      __threadfence();
      atomicExch(step_tag, tag);
    }
  }
}

// the constants program.py builds against (MegaKernel checks them once per load)
extern "C" __global__ void mega_constants(int64_t* out) {
  out[0] = NT;
  out[1] = (int64_t)SMEM;
  out[2] = SLOT;
  out[3] = KMAX;
  out[4] = (int64_t)sizeof(Instr);
  out[5] = SCRATCH;
  out[6] = MAX_SCORES;
  out[7] = SCALE_BYTES;
}
