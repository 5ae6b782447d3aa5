"""What the process runs on: the ``TQ_KERNELS`` setting and the GPU backend.

The only settings the attention reads from the environment; :func:`choose`
(``route.py``) takes both as arguments and stays pure.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Optional

import mlx.core as mx

MODES = ("auto", "gpu", "reference")


def mode() -> str:
    """``TQ_KERNELS``: ``auto`` (default: the kernels where the default device
    is a GPU with Metal or CUDA), ``gpu`` (force them; an error without one)
    or ``reference`` (the pure-MLX path everywhere)."""
    m = os.environ.get("TQ_KERNELS", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"TQ_KERNELS={m!r}: choose one of {', '.join(MODES)}")
    return m


@lru_cache(maxsize=1)
def backend() -> Optional[str]:
    """``"metal"``, ``"cuda"`` or None: which kernel language this MLX build
    runs (fixed for the process: asked once, not on every decode step)."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def on_gpu() -> bool:
    """Whether MLX's default device is the GPU."""
    return mx.default_device() == mx.gpu


def use_kernels() -> bool:
    """Whether the GPU kernels may run at all (``TQ_KERNELS`` and the device)."""
    from .route import kernels_allowed  # (route imports this module)

    return kernels_allowed(backend(), mode(), on_gpu())
