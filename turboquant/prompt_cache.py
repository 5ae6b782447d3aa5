"""Build the per-layer cache list for a loaded mlx-lm or mlx-vlm model.

Only plain full-attention ``KVCache`` layers (exact type: mlx-lm's or
mlx-vlm's) are converted.  Sliding-window (``RotatingKVCache``), MLA,
state-space (``ArraysCache``) and other special caches are returned as the
model made them: their attention either is not a plain softmax over all
tokens or is already bounded, and quantizing them would change the model.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Optional

import mlx.nn as nn

from .attention.device import backend, mode, on_gpu
from .attention.route import block_mean_wanted
from .cache import TurboQuantKVCache
from .integration import install
from .policy import SINK_TOKENS, parse_kv_policy
from .rotary import MEAN_PAIRS, Rotary


def _plain_kv_types() -> tuple[type, ...]:
    from mlx_lm.models.cache import KVCache

    types: list[type] = [KVCache]
    try:
        from mlx_vlm.models.cache import KVCache as VLMKVCache

        types.append(VLMKVCache)
    except ImportError:
        pass
    return tuple(types)


def _is_vlm(model: nn.Module) -> bool:
    return hasattr(model, "language_model") and type(model).__module__.startswith("mlx_vlm.")


def _default_caches(model: nn.Module, max_kv_size: Optional[int]) -> list[Any]:
    if _is_vlm(model):
        from mlx_vlm.models.cache import make_prompt_cache as vlm_make

        return list(vlm_make(model.language_model, max_kv_size=max_kv_size))
    from mlx_lm.models.cache import make_prompt_cache as lm_make

    return list(lm_make(model, max_kv_size=max_kv_size))


def _direct_sdpa_modules(model: nn.Module) -> list[str]:
    """Model modules that read cache output with ``mx.fast`` attention directly.

    Those bypass the wrapped base function, so a TurboQuant cache there
    would silently attend to the exact window only.
    """
    bad = []
    names = {type(m).__module__ for _, m in model.named_modules()}
    for name in sorted(names):
        module = sys.modules.get(name)
        if module is None or not name.startswith(("mlx_lm.models.", "mlx_vlm.models.")):
            continue
        try:
            src = inspect.getsource(module)
        except (OSError, TypeError):
            continue
        if "update_and_fetch" in src and "mx.fast.scaled_dot_product_attention" in src:
            bad.append(name)
    return bad


def make_prompt_cache(
    model: nn.Module,
    kv_bits: Optional[float] = None,
    kv_quant_scheme: str = "turboquant",
    *,
    key_bits: Optional[int] = None,
    value_bits: Optional[int] = None,
    seed: int = 0,
    window: int = 128,
    sinks: int = SINK_TOKENS,
    affine_group_size: int = 64,
    max_kv_size: Optional[int] = None,
    quantizer: str = "scalar",
) -> list[Any]:
    """Per-layer caches for ``model`` with the requested KV compression
    (``kv_bits`` unset: 3.5 for turboquant, 4 for affine).

    The options are parsed once into a :class:`~turboquant.policy.KVQuantPolicy`
    (``parse_kv_policy``), which every cache built here holds.
    ``"turboquant"``: ``TurboQuantKVCache`` on every plain ``KVCache`` layer,
    rotation seed ``seed + layer index``, the first ``sinks`` tokens and
    the last ``window`` tokens exact; also installs the attention hook
    (``integration.install``).  ``"affine"``: mlx's
    ``QuantizedKVCache(affine_group_size, int(kv_bits))`` on the same layers
    (``affine.PaddedQuantizedKVCache``: padded to a round length on CUDA,
    where the attention hook is installed too).
    ``"fp16"``: the model's own caches (the baseline; the model's dtype).
    """
    if kv_bits is None:  # the scheme's usual width: 3.5 has no affine form
        kv_bits = 4 if kv_quant_scheme == "affine" else 3.5
    policy = parse_kv_policy(
        kv_bits, kv_quant_scheme, key_bits=key_bits, value_bits=value_bits, quantizer=quantizer,
        window=window, sinks=sinks, seed=seed, affine_group_size=affine_group_size,
    )
    caches = _default_caches(model, max_kv_size)
    if policy.scheme == "fp16":
        return caches
    plain = _plain_kv_types()
    layers = [i for i, c in enumerate(caches) if type(c) in plain]

    if policy.scheme == "affine":
        if _is_vlm(model):
            from mlx_vlm.models.cache import QuantizedKVCache
        else:
            from mlx_lm.models.cache import QuantizedKVCache
        from .affine import PaddedQuantizedKVCache, cuda_pad_multiple

        pad = cuda_pad_multiple()  # odd lengths have no CUDA kernel: see affine.py
        for i in layers:
            caches[i] = (
                PaddedQuantizedKVCache(group_size=policy.affine_group_size, bits=policy.affine_bits, pad_multiple=pad)
                if pad > 1 else QuantizedKVCache(group_size=policy.affine_group_size, bits=policy.affine_bits)
            )
        if pad > 1 and layers:
            install()  # the attention goes to affine.dequantized_attention
        return caches

    if layers:
        bad = _direct_sdpa_modules(model)
        if bad:
            raise ValueError(
                "make_prompt_cache: these model modules call "
                "mx.fast.scaled_dot_product_attention on the cache output directly, "
                f"bypassing the TurboQuant attention hook: {', '.join(bad)}; "
                "use kv_quant_scheme='fp16' or 'affine' for this model"
            )
        install()
    rotaries = _layer_rotaries(model)
    blocks = block_mean_wanted(backend(), mode(), on_gpu())
    for i in layers:
        caches[i] = TurboQuantKVCache(policy=policy, layer=i)
        caches[i].rotary = rotaries.get(i)
        caches[i].mean_blocks = blocks
        caches[i].mean_pairs = MEAN_PAIRS if blocks else 0
    return caches


def _layer_rotaries(model: nn.Module) -> dict[int, Rotary]:
    """Each layer's RoPE angles where its kind is known (``Rotary.of``)."""
    out: dict[int, Rotary] = {}
    for i, layer in enumerate(getattr(model, "layers", None) or []):
        r = Rotary.of(getattr(getattr(layer, "self_attn", None), "rope", None))
        if r is not None:
            out[i] = r.canonical()
    return out
