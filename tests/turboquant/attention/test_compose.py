"""The MLX around the kernels (compose.py, launchers.py hooks), with the kernels replaced by MLX ops."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from packed_fixtures import close, codec_quantize, dense_reference, fake_decode, fake_dequant, filled_cache, rel

from turboquant.attention import compose, device, launchers, table, turboquant_attention
from turboquant.attention.pair_tables import kernel_tables, pair_table
from turboquant.attention.reference import reference_attention
from turboquant.codebooks import codebook
from turboquant.codec import TurboQuantCodec
from turboquant.policy import SINK_TOKENS
from turboquant.rotation import HadamardRotation


@pytest.fixture
def cpu_kernels(monkeypatch):
    """The kernel routes on CPU: a GPU backend is claimed, the kernels are MLX ops."""

    def use(backend: str):
        monkeypatch.setattr(device, "backend", lambda: backend)
        monkeypatch.setattr(device, "on_gpu", lambda: True)
        monkeypatch.setattr(launchers, "decode", fake_decode)
        monkeypatch.setattr(launchers, "dequantize", fake_dequant)
        monkeypatch.setattr(launchers, "key_bias", launchers.key_bias_ops)
        monkeypatch.setattr(launchers, "quantize_any", codec_quantize)  # no GPU to append with

    return use


@pytest.mark.parametrize("key_scale", [False, True])
@pytest.mark.parametrize("block_mean", [False, True])
@pytest.mark.parametrize("backend,L,mask", [("metal", 1, None), ("metal", 2, "causal"), ("metal", 64, "causal"),
                                            ("metal", 3, "array"), ("cuda", 2, "causal"), ("cuda", 64, "causal"),
                                            ("cuda", 3, "array"), ("metal", 3, "full"), ("cuda", 5, "full")])
def test_glue_matches_reference_on_cpu(cpu_kernels, backend, L, mask, block_mean, key_scale):
    """The kernel routes' Python glue (rotation, centring, the block mean's
    key bias, window merge, masks, SDPA over [history; window]) with the
    kernels replaced by MLX ops must equal the reference path: this runs in
    CI, where no GPU is."""
    cpu_kernels(backend)
    d, h_kv, g = 64, 2, 4
    cache = filled_cache(3.5, d, h_kv, 300, block_mean=block_mean)
    if key_scale:  # the prefill's queries, uneven over channels: the first flush scales keys from them
        cache.observe_queries(mx.random.normal((1, h_kv * g, 16, d)) * mx.linspace(0.2, 3.0, d))
    k = mx.random.normal((1, h_kv, L, d))
    if mask == "array":  # built before the update, as models do
        mask = cache.make_mask(L, return_array=True)
    wk, wv = cache.update_and_fetch(k, k * 0.5 - 0.2)
    assert (cache.key_mean_pre is not None) == block_mean
    assert (cache.key_scale is not None) == key_scale
    if mask == "full":  # position order (sinks, packed, recent), hiding some history and a sink
        n = cache.offset
        mask = (mx.arange(n - L, n)[:, None] >= mx.arange(n)[None]) & (mx.arange(n) % 3 != 1)
        mask = mask | (mx.arange(n)[None] == mx.arange(n - L, n)[:, None])
        assert cache.sink_len == SINK_TOKENS and not mask[0, 1].item()
    q = mx.random.normal((1, h_kv * g, L, d))
    out = turboquant_attention(q, wk, wv, cache, d**-0.5, mask)
    ref = reference_attention(q, wk, wv, cache, d**-0.5, mask)
    assert rel(out, ref) < 1e-5
    if not isinstance(mask, str) and mask is not None and mask.shape[-1] == cache.offset:
        close(ref, dense_reference(q, cache, wk, wv, d**-0.5, mask), tol=1e-4)  # columns in position order


def test_prefill_never_holds_more_than_the_dequant_limit(cpu_kernels, monkeypatch):
    """Past PREFILL_DEQUANT_BYTES the prefill goes blockwise (reference path)
    instead of dequantizing the whole history."""
    cpu_kernels("metal")
    calls = []
    monkeypatch.setattr(launchers, "dequantize", lambda *a, **k: calls.append(1) or fake_dequant(*a, **k))
    d, h_kv, g, L = 64, 2, 4, 32
    cache = filled_cache(3.5, d, h_kv, 300)
    k = mx.random.normal((1, h_kv, L, d))
    wk, wv = cache.update_and_fetch(k, k * 0.5)
    q = mx.random.normal((1, h_kv * g, L, d))
    need = 2 * 2 * h_kv * (cache.packed_len + wk.shape[2]) * d * 4

    monkeypatch.setattr(table, "PREFILL_DEQUANT_BYTES", need)  # fits exactly
    fast = turboquant_attention(q, wk, wv, cache, d**-0.5, "causal")
    assert len(calls) == 2  # keys and values dequantized once each

    monkeypatch.setattr(table, "PREFILL_DEQUANT_BYTES", need - 1)  # one byte short
    bounded = turboquant_attention(q, wk, wv, cache, d**-0.5, "causal")
    assert len(calls) == 2  # no further whole-history dequantize
    ref = reference_attention(q, wk, wv, cache, d**-0.5, "causal")
    assert mx.array_equal(bounded, ref)
    assert rel(fast, ref) < 1e-5


def test_window_attention_in_blocks_equals_one_block(monkeypatch):
    """Prefill chunks attend to their exact window in blocks of query
    positions (bounded float32 scores); the blocks must not change the result."""
    B, H, G, L, W, D = 1, 2, 4, 37, 50, 64
    q = mx.random.normal((B, H, G * L, D))
    k, v = mx.random.normal((B, H, W, D)), mx.random.normal((B, H, W, D))
    mask = mx.arange(W - L, W)[:, None] >= mx.arange(W)[None]
    lse1, out1 = compose.window_attention(q, k, v, mask, G, L)
    monkeypatch.setattr(table, "WINDOW_SCORES_BYTES", 4 * B * H * G * W * 5)  # 5 positions
    lse2, out2 = compose.window_attention(q, k, v, mask, G, L)
    assert float(mx.abs(lse1 - lse2).max()) < 1e-4 and float(mx.abs(out1 - out2).max()) < 1e-4
    s = (q.reshape(B, H, G, L, D) @ k.swapaxes(-1, -2)[:, :, None])
    s = mx.where(mask, s, -1e30)
    ref = mx.softmax(s, axis=-1) @ v[:, :, None]
    assert float(mx.abs(out2 - ref.reshape(B, H, G * L, D)).max()) < 1e-4


@pytest.mark.parametrize("bits,copies", [(2, 32), (3, 32), (4, 32), (4, 16)])
def test_pair_table_layout(bits, copies):
    """Entry e = i0 | i1 << bits, copy c sits at e * copies + c and holds
    half2(c[i0], c[i1]) with c[i0] in the low 16 bits (the lower mma index)."""
    cents = codebook(bits, 128).centroids_mx()
    table_ = np.asarray(pair_table(cents, bits, copies))
    assert table_.shape == ((1 << (2 * bits)) * copies,)
    c16 = np.asarray(cents).astype(np.float16)
    for e in (0, 1, (1 << (2 * bits)) - 1, 5 % (1 << (2 * bits))):
        for c in (0, copies - 1):
            w = int(table_[e * copies + c])
            lo = np.array([w & 0xFFFF], np.uint16).view(np.float16)[0]
            hi = np.array([w >> 16], np.uint16).view(np.float16)[0]
            assert lo == c16[e & ((1 << bits) - 1)] and hi == c16[e >> bits]
    assert pair_table(cents, bits, copies) is pair_table(cents, bits, copies)  # built once


def test_kernel_tables_take_the_table_copies():
    """The 3.5-bit default (4-bit keys, 3-bit values) gets both tables in 32
    copies; 4-bit keys and values 16 each (64 KB would not fit)."""
    k4, v3 = codebook(4, 128).centroids_mx(), codebook(3, 128).centroids_mx()
    assert [t.size for t in kernel_tables(k4, 4, v3, 3)] == [256 * 32, 64 * 32]
    assert [t.size for t in kernel_tables(k4, 4, k4, 4)] == [256 * 16, 256 * 16]


def test_supports_quantize():
    assert launchers.supports_quantize(TurboQuantCodec(128, 3, HadamardRotation(128, 1)))
    assert launchers.supports_quantize(TurboQuantCodec(64, 2, HadamardRotation(64, 1)))
    assert not launchers.supports_quantize(TurboQuantCodec(96, 3, HadamardRotation(96, 1)))


def test_cache_flush_goes_through_the_quantize_hook(monkeypatch):
    """The cache quantizes via launchers.quantize_any (the fused kernel on a GPU)."""
    from turboquant.cache import TurboQuantKVCache

    seen = []
    real = launchers.quantize_any
    monkeypatch.setattr(launchers, "quantize_any", lambda x, codec: seen.append(codec.bits) or real(x, codec))
    cache = TurboQuantKVCache(kv_bits=3.5, window=4)
    k = mx.random.normal((1, 2, 10, 64))
    cache.update_and_fetch(k, k)
    cache.update_and_fetch(k[:, :, :1], k[:, :, :1])
    assert cache.packed_len == 6 - SINK_TOKENS and seen == [4, 3]  # 3.5 bits: 4-bit keys, 3-bit values


def test_reference_fallback(monkeypatch):
    """TQ_KERNELS=reference: turboquant_attention is the reference path, exactly."""
    monkeypatch.setenv("TQ_KERNELS", "reference")
    cache = filled_cache(3.5, 64, 2, 40, window=8)
    k = mx.random.normal((1, 2, 1, 64))
    wk, wv = cache.update_and_fetch(k, k)
    assert cache.packed_len > 0
    q = mx.random.normal((1, 8, 1, 64))
    out = turboquant_attention(q, wk, wv, cache, 0.125)
    assert mx.array_equal(out, reference_attention(q, wk, wv, cache, 0.125))


def test_exactly_one_turboquant_attention():
    import pathlib
    import re

    import turboquant

    root = pathlib.Path(turboquant.__file__).parent
    defs = [p for p in root.rglob("*.py") if re.search(r"^def turboquant_attention\(", p.read_text(), re.M)]
    assert [p.relative_to(root).as_posix() for p in defs] == ["attention/dispatch.py"]
    assert turboquant.turboquant_attention is turboquant_attention
