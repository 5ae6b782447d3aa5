"""Attention on the packed TurboQuant cache.

Data flow: ``dispatch.turboquant_attention`` describes the call
(``route.describe``), ``route.choose`` returns its :class:`Route`, and the
route runs: ``reference`` (pure MLX), ``compose.split_k_attention`` (SIMT,
TC, TC8 kernels from ``launchers``), ``compose.dequant_sdpa_attention``, or
``step_plan`` (the fused decode step).  Launch shapes live in ``table``,
kernel sources in ``sources`` (files under ``metal/``; on CUDA compiled once
per machine by ``cubins``), parameter arrays in ``params``.  Apple GPUs would run the shared kernels (SIMT decode, reduce,
dequantize, quantize); the tensor-core routes are CUDA only; no kernel has
been compiled for Metal yet.
"""

from .dispatch import turboquant_attention
from .route import Call, Route, choose

__all__ = ["Call", "Route", "choose", "turboquant_attention"]
