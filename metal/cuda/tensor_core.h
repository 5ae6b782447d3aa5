// Helpers of the CUDA-only kernels (tq_decode_tc*.inc): tensor-core
// fragments, shared-memory tables, atomics and cache-hinted loads.  Pasted
// after backend_cuda.h and tq_common.h (cuda_fp16.h: MLX's JIT preamble).
#pragma once

// --- tq_decode_tc.inc and tq_decode_tc8*.inc -------------------------------

// half2(a, b) as raw bits, a in the low half (the lower k / n index).
__device__ __forceinline__ unsigned int tq_half2_bits(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned int*>(&h);
}
template <typename T>  // T: MLX's float16 element type (exact round trip)
__device__ __forceinline__ unsigned int tq_pack_half_bits(T a, T b) {
  return tq_half2_bits(static_cast<float>(a), static_cast<float>(b));
}
__device__ __forceinline__ float2 tq_unpack_half2(unsigned int u) {
  return __half22float2(*reinterpret_cast<__half2*>(&u));
}
// 32-bit shared-memory read at a byte offset from a shared array.  With a
// __shared__ array and a constant added to the offset, nvcc folds both into
// the LDS (LDS R, [R_off + UR_base + imm]): no base add per lookup.
__device__ __forceinline__ unsigned int tq_lds(const unsigned int* smem_array, unsigned int byte_off) {
  return *reinterpret_cast<const unsigned int*>(reinterpret_cast<const char*>(smem_array) + byte_off);
}
// Low 32 bits of (hi:lo) >> sh, 0 <= sh < 32.
__device__ __forceinline__ unsigned int tq_funnel(unsigned int lo, unsigned int hi, int sh) {
  return __funnelshift_r(lo, hi, sh);
}
// A token's packed row split across `lanes` lanes, lane i owning stream bits
// [i * bits, (i + 1) * bits): the words a lane loads to hold its bits (the
// most over the lanes; e.g. 48 bits at offsets 0 or 16 fit 2 words, not 3),
// and whether every lane's loads stay inside the row of `row_words` words.
__host__ __device__ constexpr int tq_lane_words(int bits, int lanes) {
  int most = 0;
  for (int i = 0; i < lanes; ++i) {
    const int w = ((i * bits) % 32 + bits + 31) / 32;
    most = w > most ? w : most;
  }
  return most;
}
// Whether a lane's `bits` of a row of `row_words` words are whole words, 2
// or 4 of them (its `words` registers): then they start 8- or 16-byte
// aligned (MLX buffers are, and a view of the packed cache never cuts a
// row) and one vector load fetches them.
__host__ __device__ constexpr bool tq_lane_vector(int bits, int words, int row_words) {
  return bits == 32 * words && (words == 2 || words == 4) && row_words % words == 0;
}
// Byte offsets of the key and value pair tables in shared memory, from
// their sizes: the smaller at 0, the other right after it.  A lookup's LDS
// then takes the second offset (at most 16 KB) as its immediate; the ptxas
// behind MLX 0.32.4's CUDA JIT did not fold 32 KB there (one more LOP3 per
// lookup, 9% of the 4-bit-key / 3-bit-value decode loop).
__host__ __device__ constexpr unsigned int tq_key_table_at(int key_bytes, int value_bytes) {
  return key_bytes <= value_bytes ? 0u : (unsigned int)value_bytes;
}
__host__ __device__ constexpr unsigned int tq_value_table_at(int key_bytes, int value_bytes) {
  return key_bytes <= value_bytes ? (unsigned int)key_bytes : 0u;
}
__host__ __device__ constexpr bool tq_lane_words_in_row(int bits, int lanes, int row_words) {
  for (int i = 0; i < lanes; ++i)
    if ((i * bits) / 32 + tq_lane_words(bits, lanes) > row_words) return false;
  return true;
}
// 3-bit codes of two tokens, a (low) and b (high), as 24-bit runs of 8 dims:
// the pair-table indices (a | b << 3) of the even dims land in the 6-bit
// fields of x, those of the odd dims in the fields of y (field i: dims 2i,
// 2i + 1 of the run) -- four instructions for four pairs, where extracting
// each code costs two and the merge one more.  Bits above 24 are cleared.
__device__ __forceinline__ void tq_pairs3(unsigned int a, unsigned int b, unsigned int& x, unsigned int& y) {
  constexpr unsigned int EVEN = 0x1C71C7u, ODD = EVEN << 3;
  x = (a & EVEN) | ((b << 3) & ODD);
  y = ((a >> 3) & EVEN) | (b & ODD);
}
// A lane's 3-bit value codes of its four tokens va[j] (funnelled to bit 0)
// as pair-table indices per run of 8 dims: xw / yw [token pair][run] (tokens
// 2t, 2t+1 | 2t+8, 2t+9; RUNS = 2 at D = 128, 1 at 64).
template <int VW, int RUNS>
__device__ __forceinline__ void tq_pair_runs3(const unsigned int (&va)[4][VW], unsigned int (&xw)[2][RUNS],
                                              unsigned int (&yw)[2][RUNS]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
    for (int h = 0; h < RUNS; ++h) {
      const unsigned int a = h ? tq_funnel(va[2 * hh][0], va[2 * hh][VW - 1], 24) : va[2 * hh][0];
      const unsigned int b = h ? tq_funnel(va[2 * hh + 1][0], va[2 * hh + 1][VW - 1], 24) : va[2 * hh + 1][0];
      tq_pairs3(a, b, xw[hh][h], yw[hh][h]);
    }
  }
}
// `width` bits at stream bit `bit` of a lane's aligned words (bit and width
// are compile-time after unrolling, so the array stays in registers).
template <int N>
__device__ __forceinline__ unsigned int tq_bits(const unsigned int (&a)[N], int bit, int width) {
  const int w = bit >> 5, sh = bit & 31;
  unsigned int v = a[w] >> sh;
  if (sh + width > 32 && w + 1 < N) v |= a[w + 1] << (32 - sh);
  return v & ((1u << width) - 1u);
}
// c[0..3] += A(16x16, f16) * B(16x8, f16), fp32 accumulate (g = lane/4,
// t = lane%4): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..2t+1], a2 = A[g][2t+8..2t+9],
// a3 = A[g+8][2t+8..2t+9]; b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g];
// c = C[g][2t..2t+1], C[g+8][2t..2t+1].
__device__ __forceinline__ void tq_mma16816(float (&c)[4], unsigned int a0, unsigned int a1,
                                            unsigned int a2, unsigned int a3,
                                            unsigned int b0, unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// The same with rows g+8 of A zero and their results dropped (decode: <= 8
// query rows): the accumulator needs 2 registers instead of 4.
__device__ __forceinline__ void tq_mma16816_top(float (&c)[4], unsigned int a0, unsigned int a2,
                                                unsigned int b0, unsigned int b1) {
  float d2, d3;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%10,%10};\n"
      : "+f"(c[0]), "+f"(c[1]), "=f"(d2), "=f"(d3)
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.0f));
}

// --- tq_decode_tc8*.inc ------------------------------------------------------
// Transpose of an 8x8 fp16 matrix held in mma fragment layout (lane holds
// row lane/4, columns 2*(lane%4), +1): afterwards the lane holds the same
// positions of the transpose.  Turns S^T's accumulator into P^T's B operand.
__device__ __forceinline__ unsigned int tq_movmatrix_trans(unsigned int x) {
  unsigned int y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
// The lane index from %laneid: a value ptxas keeps as it is, where
// threadIdx.x & 31 may be folded into other uses of the thread index.
__device__ __forceinline__ unsigned int tq_laneid() {
  unsigned int l;
  asm("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
}
// A threadgroup's arrival at a split counter, by one thread between two
// barriers: a release (the partial every thread of the threadgroup wrote
// before the first barrier is visible before the count, by cumulativity)
// and an acquire (the threadgroup that counts last then reads every other's
// partial, after the second barrier), at GPU scope: no full fence
// (MEMBAR.SC.GPU) in every thread.  Returns the old count.
__device__ __forceinline__ unsigned int tq_arrive_acq_rel(unsigned int* p) {
  unsigned int old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(p) : "memory");
  return old;
}
// Increments word i of p; returns the old value (which threadgroup came
// last, which chunk a warp takes next).  The address is formed in the
// atomic (in a loop the compiler would otherwise keep a 64-bit pointer live
// throughout) and adds bit 0 of brev(%laneid), i.e. bit 31 of the lane id:
// always 0, but per lane and not provably so.  For an atomic on an address
// it can prove uniform, ptxas emits a warp-aggregated one (vote, one
// atomic, a shuffle of the result) whose shuffle waits for the result at
// once, where the chunk loop wants the round trip to overlap two tiles (a
// per-warp value such as %clock64 is still uniform, and a plain shift of
// %laneid is seen through).
__device__ __forceinline__ unsigned int tq_atomic_inc_at(const unsigned int* p, int i) {
  unsigned int old;
  asm volatile(
      "{\n\t.reg .u32 z;\n\t.reg .u64 a;\n\t"
      "mov.u32 z, %%laneid;\n\tbrev.b32 z, z;\n\tand.b32 z, z, 1;\n\t"
      "add.u32 z, z, %2;\n\tmul.wide.u32 a, z, 4;\n\tadd.u64 a, a, %1;\n\t"
      "atom.global.add.u32 %0, [a], 1;\n\t}"
      : "=r"(old) : "l"(p), "r"(i));
  return old;
}
// Load that bypasses L1: the partials were written by other SMs.
__device__ __forceinline__ float tq_load_cg(const float* p) { return __ldcg(p); }
// Four of them from a 16-byte-aligned address, one load.
__device__ __forceinline__ void tq_load_cg4(const float* p, float (&x)[4]) {
  const float4 a = __ldcg(reinterpret_cast<const float4*>(p));
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
}
// Global -> shared copy of 16 bytes without a register round trip
// (cp.async, sm_80+): a threadgroup's table copy goes out in one burst
// while it does other work; tq_cp_async_wait_all() + a barrier before use.
__device__ __forceinline__ void tq_cp_async16(void* smem_dst, const void* src) {
  const unsigned int d = static_cast<unsigned int>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void tq_cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Cache-code loads of the decode loop (plain global loads).
__device__ __forceinline__ unsigned int tq_ldg(const unsigned int* p) { return *p; }
// N consecutive words from a 4N-byte-aligned address: one vector load for
// N = 4 or 2, which the compiler cannot emit by itself (it cannot prove the
// alignment of MLX's uint32 pointers).  A template, so every lane width
// compiles: `if constexpr` discards nothing outside one.
template <int N>
__device__ __forceinline__ void tq_load_words(const unsigned int* p, unsigned int (&w)[N]) {
  if constexpr (N == 4) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    w[0] = u.x;
    w[1] = u.y;
    w[2] = u.z;
    w[3] = u.w;
  } else if constexpr (N == 2) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x;
    w[1] = u.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = p[i];
  }
}
// --- fused decode step (tq_decode_tc8*.inc with TC8_FUSED) --------------------
__device__ __forceinline__ float tq_as_float(int bits) { return __int_as_float(bits); }
// 8 consecutive elements of a 16-byte-aligned model-dtype row, as floats.
__device__ __forceinline__ void tq_load8(const float* p, float (&x)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}
// Two packed 2-byte floats (one word) as a float2; the pointer picks the type.
__device__ __forceinline__ float2 tq_word_to_float2(const __half*, unsigned int w) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ float2 tq_word_to_float2(const __nv_bfloat16*, unsigned int w) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
template <typename T>  // __half or __nv_bfloat16: one 16-byte load
__device__ __forceinline__ void tq_load8(const T* p, float (&x)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = tq_word_to_float2(p, w[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}
// 4 consecutive elements of an 8-byte-aligned (2-byte types) or
// 16-byte-aligned (float) model-dtype row, as floats: one load.
__device__ __forceinline__ void tq_load4(const float* p, float (&x)[4]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
}
template <typename T>  // __half or __nv_bfloat16
__device__ __forceinline__ void tq_load4(const T* p, float (&x)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = tq_word_to_float2(p, u.x), b = tq_word_to_float2(p, u.y);
  x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
}
// Store a float in the output's dtype.
__device__ __forceinline__ void tq_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void tq_store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void tq_store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
