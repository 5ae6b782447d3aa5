"""``turboquant_attention``: the attention of a model layer over a TurboQuant cache."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..masks import Mask, as_5d, split_mask
from . import device
from .compose import block_mean, dequant_sdpa_attention, split_k_attention
from .reference import reference_attention
from .route import Route, choose, describe
from .step_plan import fused_step


def turboquant_attention(
    queries: mx.array, window_keys: mx.array, window_values: mx.array, cache,
    scale: float, mask: Mask = None, sinks: Optional[mx.array] = None,
) -> mx.array:
    """Attention of ``queries`` [B, H_q, L, D] over the packed history and the
    exact window (what ``cache.update_and_fetch`` returned); [B, H_q, L, Dv]
    in the queries' dtype.  ``route.choose`` picks the path; each route
    computes the same attention (the kernels within fp16-SDPA accuracy).
    """
    cache.observe_queries(queries)
    # a cached FUSED_STEP (a cache centred on a mean turned per token never takes it)
    if mask is None and sinks is None and (getattr(cache, "key_mean_pre", None) is None or block_mean(cache)):
        out = fused_step(queries, window_keys, window_values, cache, scale)
        if out is not None:
            return out
    B, H_q, L, _ = queries.shape
    H_kv, W = window_keys.shape[1], window_keys.shape[2]
    packed_mask, window_mask = split_mask(mask, L, cache.packed_len, W, cache.sink_len)
    call = describe(queries, window_keys, window_values, cache, packed_mask, window_mask, sinks,
                    device.on_gpu())
    route = choose(call, device.backend(), device.mode())
    if route is Route.REFERENCE:
        return reference_attention(queries, window_keys, window_values, cache, scale, mask, sinks)
    if route is Route.DEQUANT_SDPA:
        return dequant_sdpa_attention(queries, window_keys, window_values, cache, scale, mask)
    if route is Route.FUSED_STEP:  # reached with a mask that splits to none over the window
        out = fused_step(queries, window_keys, window_values, cache, scale)
        if out is not None:
            return out
        route = Route.TC8
    if window_mask is not None:
        window_mask = as_5d(window_mask, B, H_kv, H_q // H_kv)
    return split_k_attention(queries, window_keys, window_values, cache, scale, window_mask, route)
