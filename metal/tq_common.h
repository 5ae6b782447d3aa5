// Helpers shared by every TurboQuant kernel body, written once in the common
// subset of CUDA C++ and the Metal Shading Language (the backend header,
// included first, supplies TQ_INLINE, tq_u64 and friends).
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
