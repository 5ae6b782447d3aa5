"""Packed-cache data and kernel stand-ins shared by the attention tests (CPU and GPU)."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np

from turboquant.attention import device, sources, step_plan
from turboquant.packing import pack, unpack


def packed_tensor(rng, B, H, cap, d, bits, n, structured=False):
    """Random (or structured) indices and norms in a cache-shaped buffer."""
    idx = rng.integers(0, 1 << bits, size=(B, H, cap, d))
    if structured:  # long runs of the extreme code + huge/small norms
        idx[..., : n // 2, :] = (1 << bits) - 1
    norms = rng.uniform(0.5, 3.0, size=(B, H, cap)).astype(np.float16)
    if structured:
        norms[..., ::7] = 12.0
    words = pack(mx.array(idx.astype(np.uint32)), bits)
    return words, mx.array(norms), idx


def reference_decode(q_rot, idx_k, nk, idx_v, nv, ck, cv, n):
    """float64 softmax attention on the dequantized rotated vectors."""
    K = ck[idx_k[:, :, :n]] * nk[:, :, :n, None].astype(np.float64)
    V = cv[idx_v[:, :, :n]] * nv[:, :, :n, None].astype(np.float64)
    s = np.einsum("bhrd,bhtd->bhrt", q_rot, K)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    return np.einsum("bhrt,bhtd->bhrd", p / l, V), (m + np.log(l))[..., 0]


def rel(a, b) -> float:
    # (numpy cannot take MLX bfloat16 buffers directly)
    a, b = (np.asarray(x.astype(mx.float32) if isinstance(x, mx.array) else x, np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def filled_cache(kv_bits, d, h_kv, n, window=16, seed=0, block_mean=False):
    """A cache holding n random tokens; ``block_mean``: keys after a RoPE
    with a strong pre-RoPE offset, centred on its per-block turned mean over
    the top ``MEAN_PAIRS`` pairs and a constant mean (as caches on a GPU
    are)."""
    import mlx.nn as nn

    from turboquant.cache import TurboQuantKVCache
    from turboquant.rotary import MEAN_PAIRS, Rotary

    mx.random.seed(seed)
    cache = TurboQuantKVCache(kv_bits=kv_bits, window=window)
    k = mx.random.normal((1, h_kv, n, d)) + 0.5  # offset: exercises centring
    if block_mean:
        rope = nn.RoPE(d, base=10000.0)
        cache.rotary, cache.mean_blocks, cache.mean_pairs = Rotary.of(rope).canonical(), True, MEAN_PAIRS
        k = rope(k + 2.0 * mx.random.normal((1, h_kv, 1, d)))
    v = mx.random.normal((1, h_kv, n, d))
    cache.update_and_fetch(k, v)
    return cache


def fake_decode(q_rot, kp, kn, vp, vn, ck, cv, n, bk, bv, route=None, key_bias=None, **_):
    """What a split-K kernel computes, in MLX ops (CPU tests of the glue),
    the key bias (``launchers.key_bias``: [B*H, blocks, RP], log2 units)
    added to every score of its block of 32 tokens."""
    B, H, R, d = q_rot.shape
    K = ck[unpack(kp[:, :, :n], bk, d).astype(mx.uint32)] * kn[:, :, :n, None].astype(mx.float32)
    V = cv[unpack(vp[:, :, :n], bv, d).astype(mx.uint32)] * vn[:, :, :n, None].astype(mx.float32)
    s = q_rot @ K.swapaxes(-1, -2)
    if key_bias is not None:
        per_block = key_bias.reshape(B, H, -1, key_bias.shape[-1])[..., :R].swapaxes(-1, -2)
        s = s + mx.repeat(per_block, 32, axis=-1)[..., :n] / 1.4426950408889634
    lse = mx.logsumexp(s, axis=-1)
    return mx.exp(s - lse[..., None]) @ V, lse


def codec_quantize(x, codec):
    return tuple(codec.quantize(x))


def fake_dequant(packed, norms, c, n, bits, dim, dtype=mx.float16, mean_rot=None):
    x = c[unpack(packed[:, :, :n], bits, dim).astype(mx.uint32)] * norms[:, :, :n, None].astype(mx.float32)
    if mean_rot is not None:  # one mean per head [B, H, D], or per block of 32 tokens [B, H, blocks, D]
        x = x + (mean_rot[:, :, None, :] if mean_rot.ndim == 3 else mx.repeat(mean_rot, 32, axis=2)[:, :, :n])
    return x.astype(dtype)


class RecordingKernel:
    """Stands in for the callable ``mx.fast.cuda_kernel`` returns: records
    each launch and returns zeros of the asked shapes (kept in ``results``)."""

    def __init__(self, name, log, source=""):
        self.name, self.calls, self.log, self.results = name, [], log, []
        self.source = source  # the kernel body as MLX would compile it

    def __call__(self, **kw):
        self.calls.append(kw)
        self.log.append((self.name, kw))
        self.results.append([mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])])
        return self.results[-1]


@contextlib.contextmanager
def cuda_stand_in(monkeypatch, cuda_kernel, on_gpu=True):
    """A CUDA backend whose ``mx.fast.cuda_kernel`` is ``cuda_kernel`` (no GPU
    needed); no stand-in kernel or plan built on it outlives the block."""
    monkeypatch.setattr(device, "backend", lambda: "cuda")
    monkeypatch.setattr(device, "on_gpu", lambda: on_gpu)
    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    sources.clear_cache()
    step_plan.PLANS.clear()
    try:
        yield
    finally:
        sources.clear_cache()
        step_plan.PLANS.clear()


def dense_reference(q, cache, wk, wv, scale, mask):
    """Plain float32 softmax attention over the tokens in position order --
    the sinks (front of the exact tokens), the dequantized packed history
    with the means added back (uncentred), the recent window -- with K/V
    repeated for GQA."""
    P, S = cache.packed_len, cache.sink_len
    keys, values = wk.astype(mx.float32), wv.astype(mx.float32)
    if P:
        kh = cache.key_codec.dequantize(cache.keys_packed[:, :, :P], cache.keys_norms[:, :, :P])
        vh = cache.value_codec.dequantize(cache.values_packed[:, :, :P], cache.values_norms[:, :, :P])
        if getattr(cache, "key_scale", None) is not None:  # packed keys hold (key - means) / key_scale
            kh = kh * cache.key_scale
        if getattr(cache, "key_mean_pre", None) is not None:  # the turned mean (or its block average)
            kh = kh + cache.turned_key_mean(S, S + P)
        keys = mx.concatenate([keys[:, :, :S], kh + cache.key_mean, keys[:, :, S:]], axis=2)
        values = mx.concatenate([values[:, :, :S], vh + cache.value_mean, values[:, :, S:]], axis=2)
    G = q.shape[1] // keys.shape[1]
    keys, values = mx.repeat(keys, G, axis=1), mx.repeat(values, G, axis=1)
    s = (q.astype(mx.float32) * scale) @ keys.swapaxes(-1, -2)
    L, K = s.shape[-2:]
    if isinstance(mask, str):
        mask = mx.arange(K - L, K)[:, None] >= mx.arange(K)[None]
    if mask is not None:
        if mask.shape[-1] != K:  # window-only mask (sinks, recent): history fully visible
            ones = mx.ones((*mask.shape[:-1], P), mx.bool_)
            mask = mx.concatenate([mask[..., :S], ones, mask[..., S:]], axis=-1)
        s = mx.where(mask, s, -1e30) if mask.dtype == mx.bool_ else s + mask
    return mx.softmax(s, axis=-1) @ values


def close(a, b, tol=2e-5):
    err = mx.abs(a - b).max().item()
    assert err < tol, f"max abs error {err}"
