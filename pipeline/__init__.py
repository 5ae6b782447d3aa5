"""tqpipe: batch long-document pipeline over a TurboQuant KV cache."""

from turboquant.cpu_blas import enable_fast_cpu_blas

enable_fast_cpu_blas()  # before anything imports mlx.core
