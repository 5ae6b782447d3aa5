"""Attention masks for the packed cache: mlx-lm's mask forms, split and shaped.

Why a module of its own: the reference route and the kernel routes
(``attention/``) must read a mask the same way -- which columns
are packed history and which the exact window, and how a [B, H, L, K] mask
lines up with grouped-query scores [B, H_kv, G, L, K].
"""

from __future__ import annotations

from typing import Optional, Union

import mlx.core as mx

NEG = -1e30  # finite "minus infinity": masked rows never produce NaN

Mask = Union[None, str, mx.array]


def as_5d(mask: mx.array, B: int, H_kv: int, G: int) -> mx.array:
    """Reshape a mask [..., L, K] so it broadcasts against scores [B, H_kv, G, L, K]."""
    if mask.ndim <= 2:
        return mask
    if mask.ndim == 3:  # [B|1, L, K]
        return mask[:, None, None]
    b, h = mask.shape[:2]
    if h == 1:
        return mask[:, :, None]
    if h != H_kv * G:
        raise ValueError(
            f"turboquant_attention: mask has {h} heads, queries have {H_kv * G}"
        )
    return mask.reshape(b, H_kv, G, *mask.shape[2:])


def apply_mask(scores: mx.array, mask: Optional[mx.array]) -> mx.array:
    """Apply a boolean or additive mask to scores [B, H_kv, G, L, K]."""
    if mask is None:
        return scores
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, NEG)
    return scores + mask.astype(scores.dtype)


def split_mask(mask: Mask, L: int, n_packed: int, n_window: int):
    """Return (packed_mask, window_mask) as None or arrays [..., L, cols].

    mlx-lm passes None, "causal" or an array.  Arrays over the window only
    (what ``TurboQuantKVCache.make_mask`` builds) leave the packed history
    fully visible; arrays over all ``n_packed + n_window`` columns are split.
    """
    if mask is None:
        return None, None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"turboquant_attention: unknown mask mode {mask!r}")
        if L == 1:
            return None, None
        q = mx.arange(n_window - L, n_window)[:, None]
        return None, q >= mx.arange(n_window)[None]
    cols = mask.shape[-1]
    if cols == n_window:
        return None, mask
    if cols == n_packed + n_window:
        return mask[..., :n_packed], mask[..., n_packed:]
    raise ValueError(
        f"turboquant_attention: mask has {cols} key columns; expected the window "
        f"({n_window}) or packed + window ({n_packed + n_window})"
    )
