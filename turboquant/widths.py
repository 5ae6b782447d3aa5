"""The allowed bit widths (owned by ``turboquant.policy``; kept as a stable import path)."""

from .policy import ALLOWED_COMPONENT_BITS, ALLOWED_KV_BITS, resolve_bits

__all__ = ["ALLOWED_COMPONENT_BITS", "ALLOWED_KV_BITS", "resolve_bits"]
