// Layouts and helpers shared by every TurboQuant kernel body, written once
// in the common subset of CUDA C++ and the Metal Shading Language (the
// backend header, pasted first, supplies TQ_INLINE, tq_u64 and friends).
//
// Which kernels run where.  The shared bodies in metal/ (tq_decode: SIMT
// split-K decode, tq_decode_reduce, tq_dequant, tq_quantize) are what an
// Apple GPU would compile through mx.fast.metal_kernel; the tensor-core
// kernels in metal/cuda/ (tq_decode_tc, tq_decode_tc8, tq_decode_tc8_fused)
// use NVIDIA's mma fragment layouts and are CUDA only.  None of these
// kernels has been compiled for Metal yet: the Metal flavour is assembled
// (tests check the source strings) but never built on an Apple GPU.
//
// Packed layout (docs/architecture.md): a vector's b-bit indices form one
// little-endian bitstream in uint32 words; index i occupies stream bits
// [i*b, i*b + b); stream bit k is bit k%32 of word k/32.
#pragma once

// Bits [sh, sh + n) of the 64-bit window (hi:lo), shifted down to bit 0.
// A thread that owns DPT consecutive indices starting at a multiple of DPT
// loads the word holding its first bit and the next one; DPT*b <= 48 and
// sh <= 16 whenever DPT*b does not divide 32 (b = 3), so the window always
// covers the thread's bits.
TQ_INLINE tq_u64 tq_window(unsigned int lo, unsigned int hi, int sh) {
  return ((((tq_u64)hi) << 32) | (tq_u64)lo) >> sh;
}

// Index i (0-based) of width B inside a window produced by tq_window.
TQ_INLINE unsigned int tq_index(tq_u64 win, int i, int bits) {
  return (unsigned int)(win >> (i * bits)) & ((1u << bits) - 1u);
}

// Merge two online-softmax states (max in log2 units, sum) and return the
// factors that rescale each side's accumulator.  A side with max -inf holds
// nothing; the guard keeps exp2(-inf - -inf) from producing NaN.
TQ_INLINE float tq_safe_max(float m) {
  return m == TQ_NEG_INF ? 0.0f : m;
}

// Key bias of a cache centred on a block mean (turboquant/rotary.py): the
// packed keys lost q . mu_b, one value per query row and block b of 32
// packed tokens (rotary.MEAN_BLOCK), which the decode kernels add to every
// score of the block.  Layout kb [B*HKV][ceil(n/32)][RP], log2 units (scale
// and log2(e) folded in), RP = the rows rounded up to a multiple of 8 (pad
// rows zero), so a tc8 lane's two rows (2t, 2t+1) are one aligned float2.
TQ_INLINE int tq_key_bias_rows(int rows) {
  return ((rows + 7) >> 3) << 3;
}
TQ_INLINE long tq_key_bias_at(long bh, int n, int block, int rp) {
  return (bh * (long)((n + 31) >> 5) + block) * rp;
}

// Launch parameters.  MLX custom kernels take arrays, not scalars, so the
// host passes these as an int32 array `meta` in field order
// (turboquant/attention/params.py builds it) and a body reads it through
// the struct: `const TQ_DEVICE tq_split_params& P = *reinterpret_cast<...>(meta)`.

// tq_decode, tq_decode_reduce, tq_dequant (n, capacity) and tq_decode_tc.
struct tq_split_params {
  int n;          // packed tokens attended over (or dequantized): [0, n)
  int capacity;   // token stride of the packed arrays: the cache's capacity
  int toks;       // tokens per split
  int hkv;        // kv heads
  int splits;     // splits S per (batch, kv head)
  int rows;       // query rows R per kv head (tq_decode_tc, tq_decode_reduce);
                  // tq_dequant: mean rows per head (1, or one per 32 tokens)
  int row_tiles;  // tiles of 16 rows, ceil(R / 16) (tq_decode_tc)
};

// tq_decode_tc8 and tq_decode_tc8_fused.  Word offsets are into the float32
// workspace ws; the last five fields are read by the fused step only.
struct tq_tc8_params {
  int n;               // packed tokens attended over: [0, n)
  int capacity;        // token stride of the packed arrays
  int toks;            // tokens per split (sizes the grid; warps draw chunks)
  int hkv;             // kv heads
  int splits;          // threadgroups S per (batch, kv head); fused: packed + 1
  int rows;            // query rows R per kv head, <= 8
  int off_out;         // ws offset of out [B, HKV, R, D] (unfused only)
  int off_lse;         // ws offset of lse [B, HKV, R] (unfused only)
  int off_po;          // ws offset of the partial outputs [B, HKV, S, R, D]
  int off_pm;          // ws offset of the partial maxima [B, HKV, S, R]
  int off_pl;          // ws offset of the partial sums [B, HKV, S, R]
  int window;          // exact-window length W
  int scale_bits;      // softmax scale, the bits of a float32
  int has_key_mean;    // 1: add q.mean_k back (km holds the key mean)
  int has_value_mean;  // 1: add the value mean (vm) to the output
  int counter_offset;  // word offset of this launch's counter set in cnt
};
