"""Route REFERENCE: attention straight on the packed cache in pure MLX (any device).

For the packed history the keys are ``k = R^T (norm_k * c[idx_k]) + mean_k``
(``R`` the rotation, ``c`` the codebook) and likewise for values, so

* scores: ``q·k = (R q)·c[idx_k] * norm_k + q·mean_k`` -- rotate the queries
  once, multiply by the *codebook values* of one block at a time, scale by
  the norms; ``q·mean_k`` is one dot per query row;
* values: ``sum_t p_t v_t = R^T (sum_t p_t norm_v c[idx_v]) + (sum_t p_t) mean_v``
  -- aggregate in the rotated domain, rotate back once at the end.

The history is walked in blocks (``BLOCK``, ``BLOCK_ELEMENTS``) with an online softmax
(running max, sum and accumulator in float32), so beyond the packed cache
itself only one block of codebook values / scores is ever alive.  The exact
window (recent tokens in the model dtype) is attended densely and merged
with the packed part by their softmax statistics.

GQA/MQA: queries are reshaped to [B, H_kv, G*L, D] so every kv head is read
once for all its query heads (never repeated per query head).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import mlx.core as mx

from ..decode import block_decoder
from ..masks import NEG, Mask, apply_mask, as_5d, split_mask

BLOCK = 4096  # most packed tokens per step of the online softmax
BLOCK_ELEMENTS = 1 << 18  # and at most B*H_kv*T*max(D, rows) codes/scores per step.
# Small blocks stay in the CPU caches: at 16k tokens (8 kv heads, d=128) 64- and
# 1024-token blocks measured 1.35x / 1.37x the time of these 256-token ones.


def code_key(codec) -> tuple:
    """Hashable description of how ``codec``'s words decode (scalar or TCQ)."""
    key = getattr(codec, "code_key", None)
    return key if key is not None else ("scalar", codec.bits, codec.dim)


def _block_step(kkey: tuple, vkey: tuple):
    """One online-softmax step over one block of packed tokens.

    ``(q_rot, key words, key norms, value words, value norms, m, s, acc,
    mask)`` -> ``(m, s, acc)``; ``q_rot`` is in the key decoder's slot
    layout and ``acc`` in the value decoder's (``decode``); ``mask`` is
    None or broadcasts against the scores viewed as [B, H_kv, G, L, T]
    (``G``/``L`` come from its shape).  The decoders are compiled kernels of
    their own; only the arithmetic after them is compiled here (``_update``):
    compiling both into one graph let MLX fuse the decode's select trees
    with neighbouring ops into much slower kernels (3-4x on CPU).
    """
    kdec, vdec = block_decoder(kkey), block_decoder(vkey)
    update = _update(kdec.offsets is not None, vdec.offsets is not None)
    update_added = _update(kdec.offsets is not None, vdec.offsets is not None, keys_added=True)
    koff = kdec.offsets if kdec.offsets is not None else mx.array(0.0)
    voff = vdec.offsets if vdec.offsets is not None else mx.array(0.0)

    def step(q_rot, kw, kn, vw, vn, m, s, acc, mask=None, kadd=None):
        if kadd is not None:  # [B, H_kv, T, slots] added to the keys (norms applied)
            return update_added(q_rot, kdec.codes(kw), kn, vdec.codes(vw), vn, m, s, acc, koff, voff, mask, kadd)
        return update(q_rot, kdec.codes(kw), kn, vdec.codes(vw), vn, m, s, acc, koff, voff, mask)

    return step


@lru_cache(maxsize=None)
def _update(k_offsets: bool, v_offsets: bool, keys_added: bool = False):
    """The online-softmax update of one block from its decoded codes (compiled
    per mask presence; MLX retraces per block shape).  ``keys_added``: the
    keys are ``(c - off) * norm + kadd`` [.., T, slots], scaled before the
    product (T·slots multiplies, where scaling the scores costs rows·T)."""

    def update(q_rot, kc, kn, vc, vn, m, s, acc, koff, voff, mask=None, kadd=None):
        if keys_added:
            kc = kc - koff if k_offsets else kc
            scores = q_rot @ (kc * kn.astype(mx.float32)[..., None] + kadd).swapaxes(-1, -2)
        else:
            raw = q_rot @ kc.swapaxes(-1, -2)
            if k_offsets:  # q·(c - off) = q·c - q·off, one value per row
                raw = raw - (q_rot @ koff)[..., None]
            scores = raw * kn.astype(mx.float32)[:, :, None, :]
        if mask is not None:
            B, H, M, T = scores.shape
            L = mask.shape[-2]
            scores = apply_mask(scores.reshape(B, H, M // L, L, T), mask).reshape(B, H, M, T)
        m_new = mx.maximum(m, scores.max(axis=-1, keepdims=True))
        p = mx.exp(scores - m_new)
        corr = mx.exp(m - m_new)
        s = s * corr + p.sum(axis=-1, keepdims=True)
        w = p * vn.astype(mx.float32)[:, :, None, :]
        acc = acc * corr + w @ vc
        if v_offsets:  # sum_t w_t (c_t - off) = sum_t w_t c_t - (sum_t w_t) off
            acc = acc - w.sum(axis=-1, keepdims=True) * voff
        return m_new, s, acc

    return mx.compile(update)


def _packed_part(q_rot: mx.array, cache, packed_mask: Optional[mx.array], G: int, L: int,
                 q_plain: mx.array):
    """Online softmax over packed history.  q_rot [B, H_kv, G*L, D] (scaled);
    q_plain, the same queries unrotated (read where keys are centred on a
    turned mean, ``cache.key_mean_pre``).

    Returns running max m, sum s [B, H_kv, G*L, 1] and the rotated-domain
    value accumulator [B, H_kv, G*L, Dv] (all float32).
    """
    B, H_kv, M, D = q_rot.shape
    kkey, vkey = code_key(cache.key_codec), code_key(cache.value_codec)
    klay, vlay = block_decoder(kkey).layout, block_decoder(vkey).layout
    q_rot = klay.to_slots(q_rot)  # zero in pad slots: they add nothing to the scores
    m = mx.full((B, H_kv, M, 1), NEG, mx.float32)
    s = mx.zeros((B, H_kv, M, 1), mx.float32)
    acc = mx.zeros((B, H_kv, M, vlay.slots), mx.float32)
    P = cache.packed_len
    s0 = cache.sink_len
    # Keys centred on R(p) mean_pre (or its block average) get it back per
    # key: for a few rows (a decode step) as a score bias, q . R(p) mean
    # (rows x T x D); for many (a prefill chunk) added to the decoded keys,
    # turned and rotated per key (T x D log D), no [rows, T] bias.
    turned_mean = getattr(cache, "key_mean_pre", None) is not None
    added = turned_mean and M > klay.slots
    # one block holds codes [T, slots] and scores [M, T] per kv head
    block = max(64, min(BLOCK, BLOCK_ELEMENTS // (B * H_kv * max(klay.slots, vlay.slots, M))))
    step = _block_step(kkey, vkey)
    for a in range(0, P, block):
        e = min(P, a + block)
        args = (
            q_rot, cache.keys_packed[:, :, a:e], cache.keys_norms[:, :, a:e],
            cache.values_packed[:, :, a:e], cache.values_norms[:, :, a:e], m, s, acc,
        )
        blk_mask = None if packed_mask is None else packed_mask[..., a:e]
        kadd = None
        if added:
            turned = cache.turned_key_mean(s0 + a, s0 + e)
            if cache.key_scale is not None:
                turned = turned / cache.key_scale
            kadd = klay.to_slots(cache.rotation.forward(turned))
        elif turned_mean:
            bias = cache.key_score_bias(q_plain, s0 + a, s0 + e)
            L_ = 1 if blk_mask is None else blk_mask.shape[-2]
            bias = bias.reshape(B, H_kv, M // L_, L_, e - a)
            if blk_mask is not None:
                bias = mx.where(blk_mask, bias, NEG) if blk_mask.dtype == mx.bool_ else bias + blk_mask
            blk_mask = bias
        m, s, acc = step(*args, blk_mask, kadd)
        if e < P:
            # MLX would otherwise schedule every block's decode at once (the
            # blocks are independent until the merge): evaluating here keeps
            # one block alive, which is the whole point of the loop.
            mx.eval(m, s, acc)
    return m, s, vlay.from_slots(acc)  # pad slots dropped once per call


def reference_attention(
    queries: mx.array,
    window_keys: mx.array,
    window_values: mx.array,
    cache,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """Attention of ``queries`` [B, H_q, L, D] over packed history + exact window.

    ``window_keys``/``window_values`` are what ``cache.update_and_fetch``
    returned; the packed history ``[0, cache.packed_len)`` is read from
    ``cache``.  Returns [B, H_q, L, Dv] in the queries' dtype.
    """
    if sinks is not None:
        raise ValueError("turboquant_attention: attention sinks are not supported")
    B, H_q, L, D = queries.shape
    H_kv, W = window_keys.shape[1], window_keys.shape[2]
    if H_q % H_kv:
        raise ValueError(f"turboquant_attention: {H_q} query heads vs {H_kv} kv heads")
    G = H_q // H_kv
    M = G * L
    P = cache.packed_len
    packed_mask, window_mask = split_mask(mask, L, P, W, cache.sink_len)
    if packed_mask is not None:
        packed_mask = as_5d(packed_mask, B, H_kv, G)
    if window_mask is not None:
        window_mask = as_5d(window_mask, B, H_kv, G)

    q = (queries.astype(mx.float32) * scale).reshape(B, H_kv, M, D)

    # exact window
    scores = q @ window_keys.astype(mx.float32).swapaxes(-1, -2)
    if window_mask is not None:
        scores = apply_mask(scores.reshape(B, H_kv, G, L, W), window_mask).reshape(B, H_kv, M, W)
    m_w = scores.max(axis=-1, keepdims=True)
    p = mx.exp(scores - m_w)
    s_w = p.sum(axis=-1, keepdims=True)
    out_w = p @ window_values.astype(mx.float32)

    if P == 0:
        out = out_w / s_w
    else:
        q_codes = q if cache.key_scale is None else q * cache.key_scale
        m_p, s_p, acc = _packed_part(cache.rotation.forward(q_codes), cache, packed_mask, G, L, q)
        # Centred keys lost q·mean_k, a per-row constant of the packed part
        # only; the window is uncentred, so put it back before merging.
        m_p = m_p + q @ cache.key_mean.swapaxes(-1, -2)
        m = mx.maximum(m_p, m_w)
        a, b = mx.exp(m_p - m), mx.exp(m_w - m)
        packed_out = cache.value_rotation.inverse(acc) + s_p * cache.value_mean
        out = (a * packed_out + b * out_w) / (a * s_p + b * s_w)
    return out.reshape(B, H_q, L, -1).astype(queries.dtype)
