// Metal side of the TurboQuant kernels (compiled through
// mx.fast.metal_kernel).  Everything that differs from CUDA lives here or in
// the matching prologue in backend_metal.inc; the kernel bodies (*.inc) are
// shared verbatim with NVIDIA GPUs.
#pragma once
#include <metal_stdlib>
using namespace metal;

#define TQ_INLINE inline
#define TQ_SHARED threadgroup
#define TQ_SHARED_PTR threadgroup      // the address space of a pointer into it
#define TQ_DEVICE device
#define TQ_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define TQ_SHFL_XOR(x, m) simd_shuffle_xor((x), (ushort)(m))
#define TQ_SHFL(x, l) simd_shuffle((x), (ushort)(l))
#define TQ_ANY(p) simd_any(p)
#define TQ_EXP2(x) metal::exp2(x)
#define TQ_LOG2(x) metal::log2(x)
#define TQ_SQRT(x) metal::sqrt(x)
#define TQ_FMAX(a, b) metal::fmax((a), (b))
#define TQ_NEG_INF (-INFINITY)
#define TQ_FLOAT2(a, b) float2((a), (b))
#define TQ_FLOAT4(a, b, c, d) float4((a), (b), (c), (d))
#define TQ_TO_FLOAT(x) static_cast<float>(x)
#define TQ_TO_HALF(x) static_cast<half>(x)
#define TQ_HALF half
typedef ulong tq_u64;
