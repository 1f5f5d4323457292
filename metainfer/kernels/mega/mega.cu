// The batch-1 decode step as one persistent kernel (benchmarks/MEGAKERNEL.md). A program (built and
// checked by program.py; emulate.py is each instruction's ground truth) runs in one cooperative launch of
// one CTA per SM.
//
// Roles per CTA: warp 0 is the producer. It walks the program and streams its CTA's chunks of every
// instruction's weights through a ring of NSLOTS shared-memory slots (1-D bulk copies completing on
// mbarriers). Dense weights never wait; the experts' wait for the routing, which the producer warp
// recomputes from the router's logits. Warps 1..NCW are consumers: per instruction they build x in
// shared memory (sources polled, then the prologue), reduce the ring's chunks on the CUDA cores and store
// each output; the recurrent-state and attention instructions read their state and cache directly.
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

#include <cuda_bf16.h>

#include "ptx.cuh"

namespace {
constexpr int NCW = 8;              // consumer warps per CTA
constexpr int NT = 32 * (NCW + 1);  // threads per CTA
constexpr int CT = 32 * NCW;        // consumer threads
constexpr int SLOT = 32768;         // bytes per ring slot
constexpr int NSLOTS = 6;
constexpr int KMAX = 4608;          // floats of x
constexpr int SCRATCH = 3072;       // floats of per-op scratch
constexpr int MAX_SCORES = 1024;    // positions one attention split scores
constexpr int MAX_EXPERTS = 256;
constexpr int ROUTE_WORDS = 64;

enum : int32_t { OP_GEMV = 1, OP_GATE_UP = 2, OP_DOWN = 3, OP_DELTA = 4, OP_ATTEND = 5, OP_COMBINE = 6 };
enum : int32_t { W_E4M3 = 0, W_BF16 = 1 };
enum : int32_t { PRO_NONE = 0, PRO_RMSNORM = 1, PRO_ADD_RMSNORM = 2, PRO_GATED_NORM = 3 };
enum : int32_t { OUT_F32 = 0, OUT_BF16 = 1, OUT_PLAIN_F32 = 2 };
enum : int32_t { EPI_NONE = 0, EPI_CONV = 1 };
enum : int32_t { X_SRC = 0, X_VEC = 1, X_EMBED = 2 };
enum : int32_t { STEP_TOKEN = 0, STEP_POS = 1, STEP_KV_SLOT = 2, STEP_STATE_SLOT = 3, STEP_HAS_STATE = 4,
                 STEP_SEQ_LEN = 5 };

struct Instr {  // 160 bytes, program.py's 20 words
  int32_t op, out;  // out: the kind of this instruction's output words
  int32_t i[12];
  float f[2];
  uint64_t p[12];
};
static_assert(sizeof(Instr) == 160, "program.py packs 20 words");

constexpr size_t SMEM = (size_t)NSLOTS * SLOT + 2 * NSLOTS * sizeof(uint64_t) + KMAX * sizeof(float) +
                        SCRATCH * sizeof(float) + ROUTE_WORDS * 4;

// The watchdog. Every wait is bounded: past WAIT_LIMIT polls the first thread to give up records what it
// waited for in err[] (the program's state words 2-5: code, CTA, instruction, detail) and raises the
// abort flag there, which every other wait checks, so a broken program ends in seconds, outputs
// garbage, and says where it stalled (program.py: Program.error()).
enum : uint32_t { ERR_DATA = 1, ERR_FULL = 2, ERR_EMPTY = 3 };
constexpr uint32_t WAIT_LIMIT = 1u << 22;
__device__ uint32_t* g_err;  // state + 2 (the same value from every CTA)

__device__ __forceinline__ bool aborted() { return *reinterpret_cast<volatile uint32_t*>(g_err) != 0; }
__device__ void give_up(uint32_t code, int instr, uint32_t detail) {
  if (atomicCAS(g_err, 0u, code) == 0u) {
    g_err[1] = blockIdx.x;
    g_err[2] = (uint32_t)instr;
    g_err[3] = detail;
    __threadfence();
  }
}
__device__ __shared__ int s_instr[2];  // the instruction the producer [0] and the consumers [1] are at

// mbar_wait with the watchdog
__device__ __forceinline__ void wait_bar(uint64_t* bar, uint32_t parity, uint32_t code, int who, uint32_t detail) {
  for (uint32_t n = 0;; ++n) {
    uint32_t ok;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    if (ok) return;
    if ((n & 1023u) == 1023u && aborted()) return;
    if (n == WAIT_LIMIT) {
      give_up(code, s_instr[who], detail);
      return;
    }
  }
}

struct Smem {
  uint8_t* ring;
  uint64_t* full;
  uint64_t* empty;
  float* xs;       // [KMAX] x, permuted per 512 (xpos)
  float* sc;       // [SCRATCH]
  int* route_p;    // producer's routing: ids [16], weights [16] (as int bits)
  int* route_c;    // consumers'
};

template <typename T>
__device__ __forceinline__ T* ptr(uint64_t v) { return reinterpret_cast<T*>(v); }

__device__ __forceinline__ float bf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float bf_at(const __nv_bfloat16* p, long long e) { return __bfloat162float(p[e]); }

// x lives in shared memory permuted per 512-column group: lane L's 16 columns (base + L * 16 + q * 4 + t)
// are read as float4 q by the 32 lanes at consecutive addresses.
__device__ __forceinline__ int xpos(int e) {
  return (e & ~511) | (((e & 15) >> 2) << 7) | (((e >> 4) & 31) << 2) | (e & 3);
}

__device__ __forceinline__ float word_value(uint64_t w, int kind) {
  const uint32_t b = static_cast<uint32_t>(w);
  return kind == OUT_BF16 ? __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(b & 0xffffu)))
                          : __uint_as_float(b);
}

constexpr int FETCH_GROUP = 6;  // polled loads in flight per thread (registers: 168 per thread, 9 warps)

// one source's outputs, polled until they carry this step's tag
struct Source {
  const uint64_t* y;
  int kind;
  __device__ Source(const Instr* prog, int idx, int off) : y(ptr<const uint64_t>(prog[idx].p[4]) + off),
                                                            kind(prog[idx].out) {}
  // word e once it carries `tag` (w: a first load of it)
  __device__ uint64_t wait(int e, uint64_t w, uint32_t tag) const {
    for (uint32_t n = 0; static_cast<uint32_t>(w >> 32) != tag; ++n) {
      if ((n & 255u) == 255u && aborted()) break;
      if (n == WAIT_LIMIT) {
        give_up(ERR_DATA, s_instr[1], (uint32_t)e);
        break;
      }
      w = ld_relaxed_u64(y + e);
    }
    return w;
  }
  __device__ __forceinline__ float operator()(int e, uint32_t tag) const {
    return word_value(wait(e, ld_relaxed_u64(y + e), tag), kind);
  }
  // elements e0 + j * stride (j < n <= N) into v[] (ADD: bf16(v[j] + element)), FETCH_GROUP loads issued
  // before any is waited for: a thread's words cost ceil(n / FETCH_GROUP) L2 round trips, not n
  template <bool ADD = false, int N>
  __device__ __forceinline__ void fetch(int e0, int stride, int n, float (&v)[N], uint32_t tag) const {
#pragma unroll
    for (int g0 = 0; g0 < N; g0 += FETCH_GROUP) {
      uint64_t w[FETCH_GROUP];
#pragma unroll
      for (int j = 0; j < FETCH_GROUP; ++j)
        w[j] = g0 + j < N && g0 + j < n ? ld_relaxed_u64(y + e0 + (g0 + j) * stride) : 0ull;
#pragma unroll
      for (int j = 0; j < FETCH_GROUP; ++j)
        if (g0 + j < N && g0 + j < n) {
          const float u = word_value(wait(e0 + (g0 + j) * stride, w[j], tag), kind);
          v[g0 + j] = ADD ? bf(v[g0 + j] + u) : u;
        }
    }
  }
};

// an X (kind, idx, off at i[base..base+2], pointer p[3]): element e
struct XIn {
  int kind, n;
  Source src;
  const __nv_bfloat16* vec;
  __device__ XIn(const Instr* prog, const Instr& in, int base, int n_)
      : kind(in.i[base]), n(n_), src(prog, in.i[base] == X_SRC ? in.i[base + 1] : 0, in.i[base + 2]),
        vec(ptr<const __nv_bfloat16>(in.p[3])) {
    if (kind == X_EMBED) vec += (long long)ptr<const long long>(in.p[8])[STEP_TOKEN] * n;
  }
  // an instruction's source at i[base] (index), i[base + 1] (offset)
  __device__ XIn(const Instr* prog, const Instr& in, int base, int n_, int src_kind)
      : kind(src_kind), n(n_), src(prog, in.i[base], in.i[base + 1]), vec(nullptr) {}
  __device__ __forceinline__ float operator()(int e, uint32_t tag) const {
    return kind == X_SRC ? src(e, tag) : __bfloat162float(vec[e]);
  }
  template <int N>
  __device__ __forceinline__ void fetch(int e0, int stride, int m, float (&v)[N], uint32_t tag) const {
    if (kind == X_SRC) {
      src.fetch(e0, stride, m, v, tag);
      return;
    }
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < m) v[j] = __bfloat162float(vec[e0 + j * stride]);
  }
};

// x's elements ct + j * CT (j < ceil((K - ct) / CT)), plus add's rounded to bf16 where given, into xs (permuted),
// FETCH_GROUP at a time -> this thread's sum of their squares
__device__ float stage_raw(const XIn& x, const Source* add, int K, float* xs, uint32_t tag, int ct) {
  float ss = 0.f;
  const int m = (K - ct + CT - 1) / CT;
  for (int g0 = 0; g0 < m; g0 += FETCH_GROUP) {
    float v[FETCH_GROUP];
    const int n = min(FETCH_GROUP, m - g0);
    x.fetch(ct + g0 * CT, CT, n, v, tag);
    if (add) add->fetch<true>(ct + g0 * CT, CT, n, v, tag);
#pragma unroll
    for (int j = 0; j < FETCH_GROUP; ++j)
      if (j < n) {
        xs[xpos(ct + (g0 + j) * CT)] = v[j];
        ss += v[j] * v[j];
      }
  }
  return ss;
}

__device__ __forceinline__ void store_word(uint64_t* y, int row, float v, int kind, uint32_t tag) {
  const uint32_t bits = kind == OUT_BF16 ? static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(v)))
                                         : __float_as_uint(v);
  st_relaxed_u64(y + row, (static_cast<uint64_t>(tag) << 32) | bits);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// the consumers' sum of v (every consumer thread gets it; warp order, then lane butterflies)
__device__ float block_sum(float v, float* red, int cw, int lane) {
  v = warp_sum(v);
  consumers_sync(CT);
  if (lane == 0) red[cw] = v;
  consumers_sync(CT);
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < NCW; ++w) t += red[w];
  return t;
}

// ---- the x prologues ------------------------------------------------------------------------------
// RMSNorm of v[e] = x(e) (+ add(e), rounded to bf16) into xs: bf16(v / rms(v) * (1 + w))
__device__ void stage_norm(const XIn& x, const Source* add, const __nv_bfloat16* nw, float eps, int K, uint32_t tag,
                           const Smem& s, int ct, int cw, int lane) {
  const float ss = stage_raw(x, add, K, s.xs, tag, ct);
  const float r = rsqrtf(block_sum(ss, s.sc, cw, lane) / K + eps);
  for (int e = ct; e < K; e += CT) {
    const int q = xpos(e);
    s.xs[q] = bf(s.xs[q] * r * (1.f + bf_at(nw, e)));
  }
}

// the DeltaNet gated RMSNorm per head of hd values (reference.gated_rms_norm) of x (the core output) with z;
// thread ct holds elements ct + j * CT, so head h's hd values sit on hd / 32 warps (hd divides CT): their
// sums of squares meet in red[h * (hd / 32) + w]
__device__ void stage_gated(const XIn& x, const Source& z, const __nv_bfloat16* nw, float eps, int K, int hd,
                            uint32_t tag, const Smem& s, int ct, int cw, int lane) {
  const int m = K / CT, wph = hd / 32;
  float* red = s.sc;
  for (int g0 = 0; g0 < m; g0 += FETCH_GROUP) {  // the core values, and each head's sums of squares
    float v[FETCH_GROUP];
    const int n = min(FETCH_GROUP, m - g0);
    x.fetch(ct + g0 * CT, CT, n, v, tag);
#pragma unroll
    for (int j = 0; j < FETCH_GROUP; ++j)
      if (j < n) {
        const int e = ct + (g0 + j) * CT;
        s.xs[xpos(e)] = v[j];
        const float p = warp_sum(v[j] * v[j]);
        if (lane == 0) red[(e / hd) * wph + cw % wph] = p;
      }
  }
  consumers_sync(CT);
  for (int g0 = 0; g0 < m; g0 += FETCH_GROUP) {  // then z, and the gated norm in place
    float zz[FETCH_GROUP];
    const int n = min(FETCH_GROUP, m - g0);
    z.fetch(ct + g0 * CT, CT, n, zz, tag);
#pragma unroll
    for (int j = 0; j < FETCH_GROUP; ++j)
      if (j < n) {
        const int e = ct + (g0 + j) * CT, h = e / hd, q = xpos(e);
        float t = 0.f;
        for (int w = 0; w < wph; ++w) t += red[h * wph + w];
        const float r = rsqrtf(t / hd + eps);
        const float hh = bf(bf(s.xs[q] * r) * bf_at(nw, e % hd));
        s.xs[q] = bf(hh * (zz[j] / (1.f + __expf(-zz[j]))));
      }
  }
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
  for (int base = 0; base < K; base += 512) {
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
// logits [E + 1] (bf16 words) -> ids[0..top_k] (the picks of an fp32 softmax, ties to the lower index, then
// the shared expert E) and weights (renormalised picks, then sigmoid of logit E), into r[0..15], r[16..31]
__device__ void route_warp(const Source& lg, int E, int top_k, uint32_t tag, int* r, int lane) {
  constexpr int PER = MAX_EXPERTS / 32;
  float num[PER];
  lg.fetch(lane, 32, (E - lane + 31) / 32, num, tag);  // logit j * 32 + lane
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    if (j * 32 + lane >= E) num[j] = -INFINITY;
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
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
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
    const float g = lg(E, tag);
    r[top_k] = E;
    reinterpret_cast<float*>(r)[16 + top_k] = 1.f / (1.f + expf(-g));
  }
  __syncwarp();
}

// ---- chunk enumeration, shared by the producer and the consumers -------------------------------------
__device__ __forceinline__ int gemv_rpc(const Instr& in) { return SLOT / (in.i[2] * (in.i[0] == W_BF16 ? 2 : 1)); }
__device__ __forceinline__ int n_chunks_of(const Instr& in) {
  if (in.op == OP_GEMV) return (in.i[1] + gemv_rpc(in) - 1) / gemv_rpc(in);
  if (in.op == OP_GATE_UP) return (in.i[3] + 1) * (in.i[1] / 8);
  return 0;
}
// DOWN: row blocks of 16 outputs, each in groups of SLOT / (16 I) experts' pieces
__device__ __forceinline__ int down_per_group(const Instr& in) { return SLOT / (16 * in.i[1]); }
__device__ __forceinline__ int down_groups(const Instr& in) {
  return (in.i[3] + 1 + down_per_group(in) - 1) / down_per_group(in);
}

// Work units of an instruction (chunks, row blocks, items), dealt to the CTAs round robin, each instruction
// starting where the one before it ended: unit u of an instruction whose units start at `base` (the units of
// the instructions before it) belongs to CTA (base + u) mod gridDim.x. So every CTA gets an equal share of
// the whole step, not the first CTAs one unit more of every instruction. Producer and consumers walk the
// same bases.
__device__ __forceinline__ int n_units(const Instr& in) {
  switch (in.op) {
    case OP_GEMV:
    case OP_GATE_UP: return n_chunks_of(in);
    case OP_DOWN: return in.i[2] / 16;
    case OP_DELTA: return in.i[1] * (in.i[3] / 32);
    case OP_ATTEND: return in.i[0] * in.i[4];
    case OP_COMBINE: return in.i[0];
    default: return 0;
  }
}
// this CTA's first unit of an instruction starting at base (>= the units' count: none)
__device__ __forceinline__ int first_unit(uint32_t base) {
  return (int)((blockIdx.x + gridDim.x - base % gridDim.x) % gridDim.x);
}

// the next ring slot, once free, armed for `bytes` (the caller issues the copies into it) -> its address
__device__ __forceinline__ uint8_t* claim(const Smem& s, uint32_t it, uint32_t bytes) {
  const uint32_t slot = it % NSLOTS, rnd = it / NSLOTS;
  wait_bar(&s.empty[slot], (rnd & 1) ^ 1, ERR_EMPTY, 0, slot);
  mbar_expect_tx(&s.full[slot], bytes);
  return s.ring + slot * SLOT;
}

// The L2 lead (lead > 0): before the producer waits for a routing, it prefetches into L2 this CTA's
// chunks of the GEMV instructions after instruction i (the dense weights the routing does not decide:
// the next layer's projections), up to `lead` bytes, so the DRAM streams through the routing bubble and
// those chunks later load from L2. (The skeleton's v2 measures the idea: benchmarks/stream_chain.cu.)
__device__ void l2_lead(const Instr* prog, int n_instr, int i, uint32_t base, uint32_t lead) {
  uint32_t done = 0;
  base += n_units(prog[i]);
  for (int j = i + 1; j < n_instr && done < lead; base += n_units(prog[j]), ++j) {
    const Instr& in = prog[j];
    if (in.op != OP_GEMV) continue;
    const int rb = in.i[2] * (in.i[0] == W_BF16 ? 2 : 1), rpc = gemv_rpc(in), n = n_chunks_of(in);
    for (int c = first_unit(base); c < n && done < lead; c += gridDim.x) {
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
  uint32_t base = 0;  // the units of the instructions before (first_unit)
  for (int i = 0; i < n_instr; base += n_units(prog[i]), ++i) {
    const Instr& in = prog[i];
    const int first = first_unit(base);
    if (lane == 0) s_instr[0] = i;
    if (in.op == OP_GATE_UP || in.op == OP_DOWN) {
      if (first >= n_units(in)) continue;  // none of its units here
      if (routed != in.i[4]) {
        if (lead && lane == 0) l2_lead(prog, n_instr, i, base, lead);
        __syncwarp();
        route_warp(Source(prog, in.i[4], 0), in.i[0], in.i[3], tag, s.route_p, lane);
        routed = in.i[4];
      }
    }
    if (lane != 0) continue;
    if (in.op == OP_GEMV) {
      const int rb = in.i[2] * (in.i[0] == W_BF16 ? 2 : 1), rpc = gemv_rpc(in), n = n_chunks_of(in);
      for (int c = first; c < n; c += n_cta, ++it) {
        const uint32_t bytes = min(rpc, in.i[1] - c * rpc) * rb;
        bulk_load(claim(s, it, bytes), ptr<const uint8_t>(in.p[0]) + (size_t)c * rpc * rb, bytes,
                  &s.full[it % NSLOTS]);
      }
    } else if (in.op == OP_GATE_UP) {
      const int I = in.i[1], H = in.i[2], nb = I / 8, n = n_chunks_of(in);
      for (int c = first; c < n; c += n_cta, ++it) {  // 8 gate rows, then the 8 up rows beside them
        const int j = c / nb, b = c % nb, e = s.route_p[j];
        const uint8_t* w = ptr<const uint8_t>(in.p[0]) + ((size_t)e * 2 * I + 8 * b) * H;
        uint8_t* dst = claim(s, it, 16 * H);
        bulk_load(dst, w, 8 * H, &s.full[it % NSLOTS]);
        bulk_load(dst + 8 * H, w + (size_t)I * H, 8 * H, &s.full[it % NSLOTS]);
      }
    } else if (in.op == OP_DOWN) {
      const int I = in.i[1], H = in.i[2], slots = in.i[3] + 1, per = down_per_group(in);
      for (int rb = first; rb < H / 16; rb += n_cta)
        for (int g = 0; g < down_groups(in); ++g, ++it) {  // the 16 rows of each slot's expert, slot order
          const int n = min(per, slots - g * per);
          uint8_t* dst = claim(s, it, n * 16 * I);
          for (int j = 0; j < n; ++j)
            bulk_load(dst + j * 16 * I,
                      ptr<const uint8_t>(in.p[0]) + ((size_t)s.route_p[g * per + j] * H + rb * 16) * I, 16 * I,
                      &s.full[it % NSLOTS]);
        }
    }
  }
}

// ---- the tensor-core consumers (launch mma = 1) --------------------------------------------------------
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
  for (int item = c.first; item < Hv * nblk; item += gridDim.x) {
    const int h = item / nblk, cb = item % nblk, kh = h / (Hv / hk), col = cb * 32 + c.lane;
    float* S = ptr<float>(in.p[0]) + (((size_t)slot * Hv + h) * Dk) * Dv + col;
    float st[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) st[r] = has ? S[(size_t)(c.cw * 16 + r) * Dv] : 0.f;  // before the wait
    consumers_sync(CT);  // the scratch is free
    if (c.cw < 2) {  // warp 0: q, warp 1: k, l2-normalised (q also scaled by Dk^-0.5)
      const int off = (c.cw == 0 ? 0 : hk * Dk) + kh * Dk;
      float v[4], ss = 0.f;
      proj.fetch(off + c.lane, 32, 4, v, c.tag);
#pragma unroll
      for (int j = 0; j < 4; ++j) ss += v[j] * v[j];
      const float r = rsqrtf(warp_sum(ss) + 1e-6f) * (c.cw == 0 ? rsqrtf((float)Dk) : 1.f);
#pragma unroll
      for (int j = 0; j < 4; ++j) (c.cw == 0 ? qn : kn)[j * 32 + c.lane] = v[j] * r;
    } else if (c.cw == 2 && c.lane == 0) {
      const float a = proj(in.i[5] + h, c.tag) + bf_at(ptr<const __nv_bfloat16>(in.p[2]), h);
      const float b = proj(in.i[4] + h, c.tag);
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

// eight bf16 values (16 bytes, aligned) as floats
__device__ __forceinline__ void bf16x8(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 t = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
    f[2 * j] = t.x;
    f[2 * j + 1] = t.y;
  }
}

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

// split-KV attention of one (q head, split): warp cw scores positions lo + cw + j * NCW (lane: 8 dims)
__device__ void op_attend(Ctx& c, const Instr& in) {
  const int hq = in.i[0], hkv = in.i[1], D = in.i[2], rd = in.i[3], ns = in.i[4], bs = in.i[5];
  const Source qkv(c.prog, in.i[6], in.i[7]);
  const long long* step = ptr<const long long>(in.p[8]);
  const int L = (int)step[STEP_SEQ_LEN];
  const float pos = (float)step[STEP_POS];
  const long long kv_slot = step[STEP_KV_SLOT];
  const int* bt = ptr<const int>(in.p[6]);
  __nv_bfloat16* kc = ptr<__nv_bfloat16>(in.p[0]);
  __nv_bfloat16* vc = ptr<__nv_bfloat16>(in.p[1]);
  const float* inv_freq = ptr<const float>(in.p[5]);
  const float scale = in.f[1] * 1.4426950408889634f;
  float* q = c.s.xs;          // [256] the normed, rotated query (bf16 values)
  float* kn = q + 256;        // [256] this step's key, normed and rotated (bf16 values)
  float* vn = kn + 256;       // [256] this step's value
  float* raw = vn + 256;      // [256]
  float* score = raw + 256;   // [MAX_SCORES]
  float* red = c.s.sc;        // [NCW] sums; then [NCW][D] partial outputs
  const int per = (L + ns - 1) / ns;
  for (int item = c.first; item < hq * ns; item += gridDim.x) {
    const int h = item / ns, sp = item % ns, kvh = h / (hq / hkv);
    const int lo = sp * per, hi = min(lo + per, L);
    uint64_t* y = ptr<uint64_t>(in.p[4]) + (size_t)(h * ns + sp) * (D + 2);
    consumers_sync(CT);
    raw[c.ct] = qkv(h * 2 * D + c.ct, c.tag);
    consumers_sync(CT);
    const float qv = bf(norm_rope(raw, ptr<const __nv_bfloat16>(in.p[2]), in.f[0], pos, inv_freq, rd, red, c.ct, c.cw,
                                  c.lane));
    consumers_sync(CT);
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
    if (lo >= hi) {  // an empty split
      store_word(y, c.ct, 0.f, OUT_F32, c.tag);
      if (c.ct < 2) store_word(y, D + c.ct, c.ct == 0 ? -INFINITY : 0.f, OUT_F32, c.tag);
      continue;
    }
    // pass 1: the scores (fp32; q and k bf16 values)
    float qr[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) qr[j] = q[c.lane * 8 + j];
    float m = -INFINITY;
#pragma unroll 4
    for (int t = lo + c.cw; t < hi; t += NCW) {  // (unrolled: several cache rows in flight per warp)
      float part = 0.f;
      if (t == L - 1) {
#pragma unroll
        for (int j = 0; j < 8; ++j) part = fmaf(qr[j], kn[c.lane * 8 + j], part);
      } else {
        const long long row = (long long)bt[t / bs] * bs + t % bs;
        float k8[8];
        bf16x8(kc + (row * hkv + kvh) * D + c.lane * 8, k8);
#pragma unroll
        for (int j = 0; j < 8; ++j) part = fmaf(qr[j], k8[j], part);
      }
      const float sc = warp_sum(part) * scale;
      if (c.lane == 0) score[t - lo] = sc;
      m = fmaxf(m, sc);
    }
    m = warp_max(m);
    if (c.lane == 0) red[c.cw] = m;
    consumers_sync(CT);
    m = -INFINITY;
#pragma unroll
    for (int w = 0; w < NCW; ++w) m = fmaxf(m, red[w]);
    // pass 2: p = exp2(score - m); the sum of p, and bf16(p) times v
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, lsum = 0.f;
#pragma unroll 4
    for (int t = lo + c.cw; t < hi; t += NCW) {
      const float p = exp2f(score[t - lo] - m), pb = bf(p);
      lsum += p;
      if (t == L - 1) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = fmaf(pb, vn[c.lane * 8 + j], acc[j]);
      } else {
        const long long row = (long long)bt[t / bs] * bs + t % bs;
        float v8[8];
        bf16x8(vc + (row * hkv + kvh) * D + c.lane * 8, v8);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = fmaf(pb, v8[j], acc[j]);
      }
    }
    consumers_sync(CT);  // red's maxima are read
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

// the splits merged per head (consumer thread t: dim t), times sigmoid(gate), each rounded to bf16 first
__device__ void op_combine(Ctx& c, const Instr& in) {
  const int hq = in.i[0], D = in.i[1], ns = in.i[2];
  const Source parts(c.prog, in.i[3], in.i[4]), qkv(c.prog, in.i[5], in.i[6]);
  constexpr int G = 8;  // splits fetched at once
  for (int h = c.first; h < hq; h += gridDim.x) {
    float m = -INFINITY, lse[G], o[G];
    for (int s0 = 0; s0 < ns; s0 += G) {
      parts.fetch((h * ns + s0) * (D + 2) + D, D + 2, min(G, ns - s0), lse, c.tag);
#pragma unroll
      for (int j = 0; j < G; ++j)
        if (s0 + j < ns) m = fmaxf(m, lse[j]);
    }
    if (m == -INFINITY) m = 0.f;
    float acc = 0.f, wsum = 0.f;
    for (int s0 = 0; s0 < ns; s0 += G) {
      const int n = min(G, ns - s0);
      parts.fetch((h * ns + s0) * (D + 2) + D, D + 2, n, lse, c.tag);
      parts.fetch((h * ns + s0) * (D + 2) + c.ct, D + 2, n, o, c.tag);
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
}  // namespace

extern "C" __global__ void __launch_bounds__(NT, 1)
    mega_step(const Instr* __restrict__ prog, int n_instr, uint32_t* state, uint32_t lead, int mma) {
  extern __shared__ __align__(128) uint8_t smem[];
  Smem s;
  s.ring = smem;
  s.full = reinterpret_cast<uint64_t*>(smem + NSLOTS * SLOT);
  s.empty = s.full + NSLOTS;
  s.xs = reinterpret_cast<float*>(s.empty + NSLOTS);
  s.sc = s.xs + KMAX;
  s.route_p = reinterpret_cast<int*>(s.sc + SCRATCH);
  s.route_c = s.route_p + ROUTE_WORDS / 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t* step_tag = state;  // state: [0] the last step's tag, [1] CTAs finished, [2..5] the watchdog
  uint32_t* done = state + 1;
  const uint32_t tag = *reinterpret_cast<volatile uint32_t*>(step_tag) + 1u;
  if (threadIdx.x == 0) {
    g_err = state + 2;
    s_instr[0] = s_instr[1] = -1;
    for (int i = 0; i < NSLOTS; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], NCW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == 0) {
    producer(prog, n_instr, tag, lead, s, lane);
  } else {
    Ctx c{prog, tag, s, (int)threadIdx.x - 32, warp - 1, lane, 0u, -1, 0, mma};
    uint32_t base = 0;
    for (int i = 0; i < n_instr; base += n_units(prog[i]), ++i) {
      const Instr& in = prog[i];
      c.first = first_unit(base);
      if (threadIdx.x == 32) s_instr[1] = i;  // (read only by a thread that gives up)
      switch (in.op) {
        case OP_GEMV: op_gemv(c, in); break;
        case OP_GATE_UP: op_gate_up(c, in); break;
        case OP_DOWN: op_down(c, in); break;
        case OP_DELTA: op_delta(c, in); break;
        case OP_ATTEND: op_attend(c, in); break;
        case OP_COMBINE: op_combine(c, in); break;
        default: break;
      }
    }
  }
  __syncthreads();
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
}
