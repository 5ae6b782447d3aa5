// CUDA side of the shared TurboQuant kernels (compiled by NVRTC through
// mx.fast.cuda_kernel).  What differs from Metal lives here and in the
// prologue backend_cuda.inc; the shared bodies (metal/*.inc) are the same
// text on both backends.  The CUDA-only kernels add cuda/tensor_core.h.
#pragma once

#define TQ_INLINE __device__ __forceinline__
#define TQ_SHARED __shared__            // threadgroup memory (a declaration)
#define TQ_SHARED_PTR                 // (a pointer into it: no address-space qualifier)
#define TQ_DEVICE                     // global pointers need no qualifier
#define TQ_BARRIER() __syncthreads()
#define TQ_SHFL_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define TQ_SHFL(x, l) __shfl_sync(0xffffffffu, (x), (l))
#define TQ_ANY(p) __any_sync(0xffffffffu, (p))
#define TQ_EXP2(x) tq_ex2(x)
#define TQ_LOG2(x) log2f(x)
#define TQ_SQRT(x) sqrtf(x)
#define TQ_FMAX(a, b) fmaxf((a), (b))
#define TQ_NEG_INF (-__int_as_float(0x7f800000))
#define TQ_FLOAT2(a, b) make_float2((a), (b))
#define TQ_FLOAT4(a, b, c, d) make_float4((a), (b), (c), (d))
#define TQ_TO_FLOAT(x) static_cast<float>(x)
#define TQ_TO_HALF(x) __float2half_rn(x)
#define TQ_HALF __half
typedef unsigned long long tq_u64;
// 2^x as one MUFU.EX2 (flush-to-zero approx, ~2 ulp): exp2f adds a
// denormal range fix-up (compare, two multiplies) around it, and softmax
// weights below 2^-126 are zero to float accuracy anyway.
__device__ __forceinline__ float tq_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
