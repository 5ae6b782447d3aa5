"""The one place where TurboQuant hooks into mlx-lm and mlx-vlm.

Models in both libraries compute attention through
``models.base.scaled_dot_product_attention(queries, keys, values, cache,
scale, mask)`` with the cache they got from ``update_and_fetch``.
``install()`` wraps that function so a ``TurboQuantKVCache`` goes to
``turboquant_attention``, a ``SharedPrefixCache`` (task rows over one
document, any document cache) to ``shared_prefix_attention``, a CUDA
affine cache to ``affine.dequantized_attention`` (MLX's CUDA
quantized_matmul fails or errs on mlx-lm's product, see ``affine``) and
every other cache to the original, unchanged;
no model file is edited.  Model modules bind the function by name at import
(``from .base import scaled_dot_product_attention``), so already-imported
modules are rebound too; modules imported later pick up the wrapper from
``base``.

Coverage (mlx-lm 0.32 / mlx-vlm 0.7.10): every model whose attention calls
the base function -- llama, qwen2/qwen3, mistral, gemma3 (full-attention
layers), phi3, ... in mlx-lm; qwen2_vl, qwen2_5_vl, qwen3_vl, llava, idefics3,
... language models in mlx-vlm.  Not covered: modules that call
``mx.fast.scaled_dot_product_attention`` on cache output directly (mlx-lm:
deepseek_v41, plamo2, muse_spark; mlx-vlm: gemma2 softcapping, phi4mm,
moondream2/3, plamo2vl, deepseek_v41, glm5_next, embedding_gemma2,
phi4_siglip).  ``prompt_cache.make_prompt_cache`` refuses those instead of
returning wrong attention.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from .affine import dequantized_attention, dequantizes
from .cache import TurboQuantKVCache
from .attention import turboquant_attention
from .shared_prefix import SharedPrefixCache, shared_prefix_attention

_BASES = ("mlx_lm.models.base", "mlx_vlm.models.base")
_NAME = "scaled_dot_product_attention"


def _make_wrapper(original: Callable) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, SharedPrefixCache):  # rows over one document (its own masks)
            if sinks is not None:
                raise ValueError("shared_prefix_attention: attention sinks are not supported")
            return shared_prefix_attention(queries, keys, values, cache, scale)
        if isinstance(cache, TurboQuantKVCache):
            return turboquant_attention(queries, keys, values, cache, scale, mask, sinks)
        if sinks is None and dequantizes(cache):
            return dequantized_attention(queries, keys, values, cache, scale, mask)
        if sinks is None:
            return original(queries, keys, values, cache, scale=scale, mask=mask)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention._turboquant = True
    scaled_dot_product_attention.__doc__ = original.__doc__
    return scaled_dot_product_attention


def _rebind(prefix: str, original: Callable, wrapper: Callable) -> None:
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefix):
            continue
        if getattr(module, _NAME, None) is original:
            setattr(module, _NAME, wrapper)


def install() -> list[str]:
    """Route TurboQuant caches to ``turboquant_attention``; idempotent.

    Imports ``mlx_lm.models.base`` (and ``mlx_vlm.models.base`` when mlx-vlm
    is installed), wraps their attention function once, rebinds it in every
    imported model module and registers ``TurboQuantKVCache`` with mlx-lm's
    cache module so ``load_prompt_cache`` can rebuild it by class name.
    Returns the base modules that are wrapped.
    """
    import importlib

    wrapped = []
    for base_name in _BASES:
        try:
            base = importlib.import_module(base_name)
        except ImportError:
            continue
        current = getattr(base, _NAME)
        if getattr(current, "_turboquant", False):
            original, wrapper = current.__wrapped__, current
        else:
            original, wrapper = current, _make_wrapper(current)
            setattr(base, _NAME, wrapper)
        _rebind(base_name.rsplit(".", 1)[0] + ".", original, wrapper)
        wrapped.append(base_name)
    lm_cache = importlib.import_module("mlx_lm.models.cache")
    lm_cache.TurboQuantKVCache = TurboQuantKVCache
    return wrapped


def is_installed() -> bool:
    """True when mlx-lm's base attention is the TurboQuant wrapper."""
    base: Any = sys.modules.get("mlx_lm.models.base")
    return base is not None and getattr(getattr(base, _NAME), "_turboquant", False)
