"""The MLX around the kernels: rotations, centring, the exact window and the merge.

``split_k_attention`` (routes SIMT, TC, TC8) and ``dequant_sdpa_attention``
(route DEQUANT_SDPA) compute what the reference path computes, with the
packed history read by a kernel.
"""

from __future__ import annotations

import weakref
from typing import Optional

import mlx.core as mx

from . import launchers, table
from ..masks import apply_mask, sinks_first
from .pair_tables import centroids
from .route import Route


def cache_mean(cache, name: str, B: int, H: int) -> Optional[mx.array]:
    """The cache's per-(batch, head) mean [B, H, D] float32, or None."""
    m = getattr(cache, name, None)
    return None if m is None else m.astype(mx.float32).reshape(B, H, -1)


def block_mean(cache) -> bool:
    """Whether the packed keys are centred on a block mean (a key bias per
    block, ``turboquant.rotary``), which every kernel route adds back."""
    return getattr(cache, "mean_blocks", False) and getattr(cache, "key_mean_pre", None) is not None


_ONE = mx.array(1.0, mx.float32)


def key_scale(cache) -> mx.array:
    """What the queries are multiplied by against packed keys (the cache's
    per-channel key scale [B, H, 1, D], or 1)."""
    ks = getattr(cache, "key_scale", None)
    return _ONE if ks is None else ks


def value_rotation(cache):
    return getattr(cache, "value_rotation", None) or cache.rotation


_GLUE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _glue(rotation, vrot, scale: float, G: int, L: int):
    """Compiled (pre, post) around the split-K kernel: rotate q; window
    attention, log-sum-exp merge, inverse rotation and means, fused by
    ``mx.compile``; cached per rotation object (weakly)."""
    per_rot = _GLUE.setdefault(rotation, {})
    key = (id(vrot), float(scale), G, L)
    if key in per_rot:
        return per_rot[key]

    def pre(queries, key_scale):
        B, H_q, _, D = queries.shape
        q = (queries.astype(mx.float32) * scale).reshape(B, H_q // G, G * L, D)
        return q, rotation.forward(q * key_scale)  # packed keys hold (key - means) / key_scale

    def post(q, out_p, lse_p, window_keys, window_values, key_mean, value_mean):
        B, H_kv, R, _ = q.shape
        # centred keys lost q·mean_k (a constant per row); normalised packed
        # weights sum to 1, so the value mean comes back once
        lse_p = lse_p[..., None] + q @ key_mean[..., None]
        packed_out = vrot.inverse(out_p) + value_mean[:, :, None, :]
        scores = q @ window_keys.astype(mx.float32).swapaxes(-1, -2)
        lse_w = mx.logsumexp(scores, axis=-1, keepdims=True)
        out_w = mx.exp(scores - lse_w) @ window_values.astype(mx.float32)
        m = mx.maximum(lse_p, lse_w)
        a, b = mx.exp(lse_p - m), mx.exp(lse_w - m)
        return ((a * packed_out + b * out_w) / (a + b)).reshape(B, H_kv * G, L, -1)

    per_rot[key] = (mx.compile(pre), mx.compile(post))
    return per_rot[key]


def window_attention(q, window_keys, window_values, window_mask, G: int, L: int):
    """Exact attention of ``q`` [B, H_kv, G*L, D] (rows g*L + l) over the
    window with its mask, as (log-sum-exp, output) per row, in blocks of
    query positions so the float32 scores of a prefill chunk never exist at
    once: at most ``WINDOW_SCORES_BYTES`` per block."""
    B, H_kv, R, D = q.shape
    W = window_keys.shape[2]
    kT = window_keys.astype(mx.float32).swapaxes(-1, -2)[:, :, None]
    vw = window_values.astype(mx.float32)[:, :, None]
    q5 = q.reshape(B, H_kv, G, L, D)
    step = max(1, table.WINDOW_SCORES_BYTES // max(1, 4 * B * H_kv * G * W))
    lses, outs = [], []
    for l0 in range(0, L, step):
        l1 = min(L, l0 + step)
        scores = q5[:, :, :, l0:l1] @ kT
        mask = window_mask
        if mask is not None and mask.ndim >= 2 and mask.shape[-2] == L:
            mask = mask[..., l0:l1, :]
        scores = apply_mask(scores, mask)
        lse = mx.logsumexp(scores, axis=-1, keepdims=True)
        lses.append(lse)
        outs.append(mx.exp(scores - lse) @ vw)
        if l1 < L:
            # MLX would otherwise run the independent blocks side by side
            # and hold every block's scores at once; evaluating keeps one.
            mx.eval(lses[-1], outs[-1])
    lse_w = lses[0] if len(lses) == 1 else mx.concatenate(lses, axis=3)
    out_w = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return lse_w.reshape(B, H_kv, R, 1), out_w.reshape(B, H_kv, R, -1)


def split_k_attention(queries, window_keys, window_values, cache, scale, window_mask, route: Route):
    """The split-K kernel of ``route`` over the packed history, merged by
    log-sum-exp with exact attention over the window (``window_mask``: None
    or shaped [B, H_kv, G, L, W]-broadcastable)."""
    B, H_q, L, D = queries.shape
    H_kv = window_keys.shape[1]
    G = H_q // H_kv
    vrot = value_rotation(cache)
    pre, post = _glue(cache.rotation, vrot, scale, G, L)
    q, q_rot = pre(queries, key_scale(cache))
    out_p, lse_p = launchers.decode(
        q_rot, cache.keys_packed, cache.keys_norms, cache.values_packed, cache.values_norms,
        centroids(cache.key_codec), centroids(cache.value_codec),
        cache.packed_len, cache.key_codec.bits, cache.value_codec.bits, route,
        key_bias=launchers.key_bias(cache, q, cache.packed_len) if block_mean(cache) else None,
    )
    km = cache_mean(cache, "key_mean", B, H_kv)
    vm = cache_mean(cache, "value_mean", B, H_kv)
    km = mx.zeros((B, H_kv, D), mx.float32) if km is None else km
    vm = mx.zeros((B, H_kv, window_values.shape[-1]), mx.float32) if vm is None else vm
    if window_mask is None:
        return post(q, out_p, lse_p, window_keys, window_values, km, vm).astype(queries.dtype)
    lse_p = lse_p[..., None] + q @ km[..., None]
    packed_out = vrot.inverse(out_p) + vm[:, :, None, :]
    lse_w, out_w = window_attention(q, window_keys, window_values, window_mask, G, L)
    m = mx.maximum(lse_p, lse_w)
    a, b = mx.exp(lse_p - m), mx.exp(lse_w - m)
    out = (a * packed_out + b * out_w) / (a + b)
    return out.reshape(B, H_q, L, -1).astype(queries.dtype)


def full_mask(mask, n_packed: int, n_window: int, L: int, n_sinks: int = 0):
    """The mask for one SDPA over ``[history; window]``: None, "causal" or an
    array (a position-ordered full mask has its ``n_sinks`` sink columns moved
    behind the history, where the window holds them)."""
    if mask is None or isinstance(mask, str):
        if isinstance(mask, str) and mask != "causal":
            raise ValueError(f"turboquant_attention: unknown mask mode {mask!r}")
        return mask if L > 1 else None  # "causal" is bottom-right aligned in MLX
    cols = mask.shape[-1]
    if cols == n_packed + n_window:
        if n_sinks == 0:
            return mask
        return mx.concatenate([mask[..., n_sinks : n_sinks + n_packed],
                               sinks_first(mask, n_sinks, n_packed)], axis=-1)
    if cols != n_window:
        raise ValueError(
            f"turboquant_attention: mask has {cols} key columns; expected the window "
            f"({n_window}) or packed + window ({n_packed + n_window})"
        )
    pad_shape = (*mask.shape[:-1], n_packed)  # the history precedes every query
    pad = mx.ones(pad_shape, mx.bool_) if mask.dtype == mx.bool_ else mx.zeros(pad_shape, mask.dtype)
    return mx.concatenate([pad, mask], axis=-1)


def dequant_sdpa_attention(queries, window_keys, window_values, cache, scale, mask):
    """Dequantize the history once (one kernel per tensor, means folded in),
    then one fused SDPA over ``[history; window]`` in the rotated domain: the
    matrix units do the tiled attention.  Holds the dequantized history
    (model dtype) for the duration of the call."""
    B, H_q, L, D = queries.shape
    H_kv, W = window_keys.shape[1], window_keys.shape[2]
    P = cache.packed_len
    dtype = queries.dtype
    vrot = value_rotation(cache)
    km = cache_mean(cache, "key_mean", B, H_kv)
    vm = cache_mean(cache, "value_mean", B, H_kv)
    if block_mean(cache):  # one mean per block of packed tokens, added by the kernel
        km = cache.block_key_means(P)
    Dv = window_values.shape[-1]
    ks = getattr(cache, "key_scale", None)  # then every key term below is in the scaled domain
    if ks is not None and km is not None:
        km = km / (ks if km.ndim == 4 else ks[:, :, 0])
    k_hist = launchers.dequantize(
        cache.keys_packed, cache.keys_norms, centroids(cache.key_codec), P,
        cache.key_codec.bits, D, dtype, None if km is None else cache.rotation.forward(km),
    )
    v_hist = launchers.dequantize(
        cache.values_packed, cache.values_norms, centroids(cache.value_codec), P,
        cache.value_codec.bits, Dv, dtype, None if vm is None else vrot.forward(vm),
    )
    if getattr(cache, "key_mean_pre", None) is not None and not block_mean(cache):
        # keys centred on R(p) mean_pre (exactly, per token): add it back
        s0 = cache.sink_len
        turned = cache.rotary.turned(cache.key_mean_pre, s0, s0 + P)
        if ks is not None:
            turned = turned / ks
        k_hist = k_hist + cache.rotation.forward(turned).astype(dtype)
    wk, q = window_keys, queries
    if ks is not None:
        wk = window_keys.astype(mx.float32) / ks
        q = queries.astype(mx.float32) * mx.repeat(ks, H_q // H_kv, axis=1)
    keys = mx.concatenate([k_hist, cache.rotation.forward(wk).astype(dtype)], axis=2)
    values = mx.concatenate([v_hist, vrot.forward(window_values).astype(dtype)], axis=2)
    q_rot = cache.rotation.forward(q).astype(dtype)
    out = mx.fast.scaled_dot_product_attention(
        q_rot, keys, values, scale=scale, mask=full_mask(mask, P, W, L, cache.sink_len)
    )
    return vrot.inverse(out).astype(dtype)
