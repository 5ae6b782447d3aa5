"""The allowed bit widths (owned by ``turboquant.policy``; kept as a stable import path)."""

from .policy import AFFINE_BITS, ALLOWED_COMPONENT_BITS, ALLOWED_KV_BITS, resolve_bits

__all__ = ["AFFINE_BITS", "ALLOWED_COMPONENT_BITS", "ALLOWED_KV_BITS", "resolve_bits"]
