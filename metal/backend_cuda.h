// CUDA side of the TurboQuant kernels (compiled by NVRTC through
// mx.fast.cuda_kernel).  Everything that differs from Metal lives here or in
// the matching prologue in backend_cuda.inc; the kernel bodies (*.inc) are
// shared verbatim with Apple GPUs.
#pragma once

#define TQ_INLINE __device__ __forceinline__
#define TQ_SHARED __shared__
#define TQ_DEVICE                     // global pointers need no qualifier
#define TQ_BARRIER() __syncthreads()
#define TQ_SHFL_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define TQ_ANY(p) __any_sync(0xffffffffu, (p))
#define TQ_EXP2(x) exp2f(x)
#define TQ_LOG2(x) log2f(x)
#define TQ_SQRT(x) sqrtf(x)
#define TQ_FMAX(a, b) fmaxf((a), (b))
#define TQ_NEG_INF (-__int_as_float(0x7f800000))
#define TQ_FLOAT2(a, b) make_float2((a), (b))
#define TQ_TO_FLOAT(x) static_cast<float>(x)
#define TQ_TO_HALF(x) __float2half_rn(x)
typedef unsigned long long tq_u64;
