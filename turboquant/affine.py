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

Several query rows at once (a prefill chunk, a task's prompt) fail on CUDA
too, at any length: mlx-lm's score product broadcasts the keys over each kv
head's query heads, and MLX 0.32's CUDA ``quantized_matmul`` has no kernel
for that with more than one row (``257x512x64x4 ... activation: float32``).
That product also materializes ``rows x tokens`` float32 scores per head.
So :func:`dequantized_attention` takes those calls (the attention hook,
``integration``, routes them): keys and values dequantized, then
``mx.fast.scaled_dot_product_attention``; one decode row stays on mlx-lm's
quantized path, which reads the packed cache.

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


def dequantized_attention(queries: mx.array, keys: tuple, values: tuple, cache: "PaddedQuantizedKVCache",
                          scale: float, mask: Any) -> mx.array:
    """Attention of ``queries`` over the cache's (padded) packed ``keys`` and
    ``values`` triples, dequantized to the queries' dtype first; ``mask`` as
    :meth:`PaddedQuantizedKVCache.make_mask` returns it (padding masked)."""
    gs, bits = cache.group_size, cache.bits
    k = mx.dequantize(*keys, group_size=gs, bits=bits).astype(queries.dtype)
    v = mx.dequantize(*values, group_size=gs, bits=bits).astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def takes_dequantized(cache: Any, queries: mx.array) -> bool:
    """Whether an attention call goes to :func:`dequantized_attention`: a
    padded cache (CUDA) and more than one query row."""
    return isinstance(cache, PaddedQuantizedKVCache) and cache.pad_multiple > 1 and queries.shape[2] > 1


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
