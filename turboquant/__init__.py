"""TurboQuant KV-cache compression for MLX models (arXiv 2504.19874)."""

from .cpu_blas import enable_fast_cpu_blas

enable_fast_cpu_blas()  # must run before mlx.core is imported anywhere
