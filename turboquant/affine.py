"""mlx's affine ``QuantizedKVCache`` at every cached length, CUDA included.

On CUDA (MLX 0.32) ``mx.quantized_matmul`` has no kernel for the score
product ``queries @ keys^T`` when the number of cached tokens is odd::

    [quantized_matmul] No implementation for problem shape: 1x131073x128x32

so mlx-lm's quantized attention fails on every other decode step.  Round
lengths work.  :class:`PaddedQuantizedKVCache` therefore hands the attention
its keys/values sliced to ``offset`` rounded up to ``pad_multiple`` tokens
and masks the padding columns (a masked column gets probability exactly 0,
so the result is the unpadded one up to float summation order).  The pad
tokens are storage the cache already holds (zeros, or stale tokens after a
trim: finite, and never seen).

Beyond that, MLX 0.32.4's CUDA ``quantized_matmul`` cannot be trusted with
mlx-lm's attention product (H100, against an exact reference,
``tests/gpu/test_affine_gpu.py``): no kernel for several query rows over
the keys broadcast across a kv head's query heads (``257x512x64x4``), none
for one row at head dim 64 in float32 (``1x256x64x4``), and at head dim
128 one row over the broadcast keys gave wrong outputs (off by ~0.06 where
they lie in 0-1.9: not rounding).  So on CUDA every attention
call over the cache goes to :func:`dequantized_attention` (the attention
hook, ``integration``, routes it; ``shared_prefix`` reads such a
document the same way): keys and values dequantized, then
``mx.fast.scaled_dot_product_attention``.  The cache still stores packed
codes (its memory is the affine cache's).  The padding stays: the
dequantized path passed on the H100 at padded (round) lengths, and odd
ones were never run there.

``make_prompt_cache`` picks ``pad_multiple``: :data:`CUDA_PAD_MULTIPLE` on a
CUDA device, 1 (plain mlx-lm behaviour, no hook) elsewhere.  If a CUDA build still
finds no kernel for a padded shape, the error is re-raised naming this
limitation (:func:`explain_cuda_error`) instead of MLX's bare message.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache

CUDA_PAD_MULTIPLE = 256  # = QuantizedKVCache.step: lengths the GPU runs were measured at


def padded_length(n: int, multiple: int, capacity: Optional[int] = None) -> int:
    """``n`` rounded up to ``multiple`` (capped at ``capacity`` when given)."""
    m = max(1, int(multiple))
    p = -(-int(n) // m) * m
    return p if capacity is None else min(p, int(capacity))


def cuda_pad_multiple() -> int:
    """The padding the default device needs: CUDA_PAD_MULTIPLE on CUDA, else 1."""
    from .attention.device import backend, on_gpu

    return CUDA_PAD_MULTIPLE if backend() == "cuda" and on_gpu() else 1


def explain_cuda_error(exc: BaseException) -> BaseException:
    """A clearer error for MLX's missing quantized_matmul kernel, else ``exc``."""
    if "No implementation for problem shape" in str(exc):
        return RuntimeError(
            "affine KV cache: MLX's CUDA quantized_matmul has no kernel for this cache length "
            f"({exc}); use kv_quant_scheme 'turboquant' or 'fp16' on CUDA"
        )
    return exc


def dequantized(cache: Any, triple: tuple) -> mx.array:
    """A packed ``(codes, scales, biases)`` triple of the affine ``cache`` as values."""
    return mx.dequantize(*triple, group_size=cache.group_size, bits=cache.bits)


def dequantized_attention(queries: mx.array, keys: tuple, values: tuple, cache: "PaddedQuantizedKVCache",
                          scale: float, mask: Any) -> mx.array:
    """Attention of ``queries`` over the cache's (padded) packed ``keys`` and
    ``values`` triples, dequantized to the queries' dtype first; ``mask`` as
    :meth:`PaddedQuantizedKVCache.make_mask` returns it (padding masked)."""
    k = dequantized(cache, keys).astype(queries.dtype)
    v = dequantized(cache, values).astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def dequantizes(cache: Any) -> bool:
    """Whether attention over ``cache`` dequantizes it first: a padded
    cache, i.e. one made for CUDA (see the module docstring)."""
    return isinstance(cache, PaddedQuantizedKVCache) and cache.pad_multiple > 1


class PaddedQuantizedKVCache(QuantizedKVCache):
    """``QuantizedKVCache`` whose attention inputs are padded to ``pad_multiple`` tokens."""

    def __init__(self, group_size: int = 64, bits: int = 8, pad_multiple: int = 1):
        super().__init__(group_size=group_size, bits=bits)
        self.pad_multiple = max(1, int(pad_multiple))

    def _ensure_capacity(self, n: int) -> None:
        cap = self.keys[0].shape[-2]
        if n <= cap:
            return

        def grow(x: mx.array) -> mx.array:
            extra = mx.zeros((*x.shape[:-2], n - cap, x.shape[-1]), dtype=x.dtype)
            return mx.concatenate([x, extra], axis=-2)

        self.keys, self.values = tree_map(grow, (self.keys, self.values))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        super().update_and_fetch(keys, values)
        n = padded_length(self.offset, self.pad_multiple)
        if n == self.offset:
            return self.keys_and_values()
        self._ensure_capacity(n)
        return tree_map(lambda x: x[..., :n, :], (self.keys, self.values))

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kw) -> Any:
        """mlx-lm's mask, or, when the attention will see padding columns, a
        boolean [N, padded] causal mask with the padding masked."""
        total = self.offset + N
        n = padded_length(total, self.pad_multiple)
        if n == total:
            return super().make_mask(N, return_array=return_array, window_size=window_size, **kw)
        mask = create_causal_mask(N, self.offset, window_size=window_size)  # [N, total]
        return mx.concatenate([mask, mx.zeros((N, n - total), dtype=mx.bool_)], axis=1)
