"""TurboQuantKVCache: protocol, window/flush, growth, trim, state, bytes."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from turboquant.cache import FORMAT, TurboQuantKVCache
from turboquant.integration import install
from turboquant.policy import SINK_TOKENS


def kv(B=1, H=2, L=10, D=64, seed=0, dtype=mx.float32):
    mx.random.seed(seed)
    k = mx.random.normal((B, H, L, D)).astype(dtype)
    v = mx.random.normal((B, H, L, D)).astype(dtype)
    return k, v


def test_no_bits_attribute_and_protocol_basics():
    c = TurboQuantKVCache(3.5)
    # mlx-lm routes hasattr(cache, "bits") to affine attention
    assert not hasattr(c, "bits")
    assert (c.key_bits, c.value_bits) == (4, 3) and c.sinks == SINK_TOKENS
    assert c.empty() and c.is_trimmable() and c.offset == 0
    k, v = kv(L=5)
    wk, wv = c.update_and_fetch(k, v)
    assert c.offset == 5 and c.size() == 5 and not c.empty()
    assert mx.array_equal(wk, k) and mx.array_equal(wv, v)


def test_window_keeps_recent_tokens_exact_and_flushes_lazily():
    c = TurboQuantKVCache(4, window=8, sinks=0)
    k1, v1 = kv(L=20, seed=1)
    wk, _ = c.update_and_fetch(k1, v1)
    # the first chunk attends to itself exactly: nothing quantized yet
    assert c.packed_len == 0 and wk.shape[2] == 20
    k2, v2 = kv(L=3, seed=2)
    wk, wv = c.update_and_fetch(k2, v2)
    # 12 tokens left the window at the start of this call
    assert c.packed_len == 12 and c.offset == 23
    assert wk.shape[2] == 11
    assert mx.array_equal(wk, mx.concatenate([k1[:, :, 12:], k2], axis=2))
    assert mx.array_equal(wv, mx.concatenate([v1[:, :, 12:], v2], axis=2))
    # centring mean comes from every token seen at the first flush (each
    # channel shrunk toward 0 by James-Stein, see cache.shrunk_mean)
    from turboquant.cache import shrunk_mean

    assert mx.allclose(c.key_mean, shrunk_mean(k1, axis=2), atol=1e-6)


def test_packed_history_decodes_to_the_original_tokens():
    c = TurboQuantKVCache(4, window=0, sinks=0)
    k, v = kv(L=64, H=2, D=128, seed=3)
    c.update_and_fetch(k, v)
    c.update_and_fetch(*kv(L=1, H=2, D=128, seed=4))
    assert c.packed_len == 64
    kh = c.key_codec.dequantize(c.keys_packed[:, :, :64], c.keys_norms[:, :, :64]) + c.key_mean
    cos = (kh * k).sum(-1) / (mx.linalg.norm(kh, axis=-1) * mx.linalg.norm(k, axis=-1))
    assert cos.min().item() > 0.97  # 4-bit: cosine ~0.995 per vector


def test_values_keep_their_own_component_keys_least_squares():
    """Packed values carry the unbiased scale (codec docstring: attention
    averages them), keys the least-squares one."""
    c = TurboQuantKVCache(3, window=0, sinks=0)
    k, v = kv(L=64, H=2, D=128, seed=5)
    c.update_and_fetch(k, v)
    c.update_and_fetch(*kv(L=1, H=2, D=128, seed=6))
    assert c.value_codec.unbiased and not c.key_codec.unbiased
    vc = v.astype(mx.float32) - c.value_mean
    vh = c.value_codec.dequantize(c.values_packed[:, :, :64], c.values_norms[:, :, :64])
    along = (vh * vc).sum(-1) / (vc * vc).sum(-1)
    assert mx.allclose(along, mx.ones_like(along), atol=3e-3)


def test_growth_is_geometric_not_per_token():
    c = TurboQuantKVCache(2, window=0, sinks=0)
    for i in range(3000):
        c.update_and_fetch(*kv(L=1, D=64, seed=i % 7))
    mx.eval(c.state)
    assert c.packed_len == 2999
    # x1.5 growth from 256: 256, 384, 576, ..., 3072 -> about 7 allocations
    assert c.reallocations <= 8
    assert c.capacity >= c.packed_len


def test_reserve_avoids_regrowth():
    c = TurboQuantKVCache(3, window=4, sinks=0)
    c.reserve(5000)
    for i in range(40):
        c.update_and_fetch(*kv(L=100, seed=i % 5))
    assert c.packed_len == 4000 - 100 - 4  # last chunk + window stay exact
    assert c.reallocations == 1 and c.capacity >= 5000


def test_trim_within_window_and_into_packed_region():
    c = TurboQuantKVCache(3.5, window=4, sinks=0)
    k, v = kv(L=10)
    c.update_and_fetch(k, v)
    c.update_and_fetch(*kv(L=2, seed=5))  # packed 6, window 6
    assert (c.packed_len, c.offset) == (6, 12)
    assert c.trim(3) == 3
    assert (c.packed_len, c.offset, c.window_keys.shape[2]) == (6, 9, 3)
    assert c.trim(5) == 5  # into the packed region: just lowers packed_len
    assert (c.packed_len, c.offset, c.window_keys.shape[2]) == (4, 4, 0)
    wk, _ = c.update_and_fetch(*kv(L=2, seed=6))
    assert c.offset == 6 and wk.shape[2] == 2 and c.packed_len == 4
    assert c.trim(100) == 6 and c.offset == 0 and c.packed_len == 0


def test_nbytes_counts_allocation_and_used_nbytes_counts_tokens():
    c = TurboQuantKVCache(3.5, window=0)
    H, D = 2, 128
    c.update_and_fetch(*kv(L=300, H=H, D=D))
    c.update_and_fetch(*kv(L=1, H=H, D=D, seed=1))
    mx.eval(c.state)
    # 4-bit keys: 16 words + fp16 norm = 66 B; 3-bit values: 12 words + 2 = 50 B
    per_token = H * (66 + 50)
    # the exact tokens: the sinks and the newest token, float32 keys and values
    assert c.window_keys.shape[2] == SINK_TOKENS + 1
    window_and_means = c.window_keys.nbytes * 2 + c.key_mean.nbytes * 2
    assert window_and_means == (SINK_TOKENS + 1) * H * D * 4 * 2 + H * D * 4 * 2
    assert c.used_nbytes == (300 - SINK_TOKENS) * per_token + window_and_means
    assert c.nbytes == c.capacity * per_token + window_and_means
    assert c.nbytes >= c.used_nbytes


def test_state_round_trips_through_mlx_lm_save_and_load(tmp_path):
    install()  # registers the class with mlx_lm.models.cache for loading
    c = TurboQuantKVCache(2.5, window=5, seed=11)
    c.update_and_fetch(*kv(L=30))
    c.update_and_fetch(*kv(L=2, seed=1))
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, [c])
    (d,) = load_prompt_cache(path)
    assert isinstance(d, TurboQuantKVCache)
    assert (d.offset, d.packed_len, d.window, d.sinks, d.seed) == (32, 30 - 5 - SINK_TOKENS, 5, SINK_TOKENS, 11)
    assert (d.key_bits, d.value_bits) == (3, 2) and d.meta_state[0] == FORMAT
    for a, b in zip(c.state[:8], d.state[:8]):
        assert mx.array_equal(a, b)
    # both continue identically
    nk, nv = kv(L=1, seed=9)
    assert mx.array_equal(c.update_and_fetch(nk, nv)[0], d.update_and_fetch(nk, nv)[0])
    assert mx.array_equal(c.keys_packed[:, :, : c.packed_len], d.keys_packed[:, :, : d.packed_len])


def test_empty_cache_state_round_trips(tmp_path):
    install()
    path = str(tmp_path / "empty.safetensors")
    save_prompt_cache(path, [TurboQuantKVCache(3)])
    (d,) = load_prompt_cache(path)
    assert d.empty() and d.offset == 0 and d.key_bits == 3
    d.update_and_fetch(*kv(L=3))
    assert d.offset == 3


def test_invalid_widths_are_rejected():
    with pytest.raises(ValueError, match="kv_bits"):
        TurboQuantKVCache(5)


def test_checkpoint_restore_undoes_flushes_that_trim_cannot():
    """After tokens were flushed out of the exact window, trim leaves them
    quantized; restore returns to the checkpoint exactly (the pipeline's
    per-task rewind depends on this)."""
    import mlx.core as mx

    from turboquant.cache import TurboQuantKVCache

    mx.random.seed(3)
    cache = TurboQuantKVCache(kv_bits=3.5, window=4)
    k = mx.random.normal((1, 2, 12, 64))
    cache.update_and_fetch(k, k)
    cache.update_and_fetch(k[:, :, :1], k[:, :, :1])
    point = cache.checkpoint()
    before = (cache.offset, cache.packed_len, cache.window_keys)
    for _ in range(6):  # decode past the window: more tokens get flushed
        cache.update_and_fetch(k[:, :, :1], k[:, :, :1])
    assert cache.packed_len > before[1]
    cache.restore(point)
    assert (cache.offset, cache.packed_len) == before[:2]
    assert mx.array_equal(cache.window_keys, before[2])


def test_sinks_stay_exact_at_the_front_of_the_window():
    """The first tokens never leave the exact tokens, whatever the window:
    prefill, decode past the window, then trim back."""
    c = TurboQuantKVCache(3.5, window=0, sinks=3)
    k, v = kv(L=20, seed=4)
    wk, _ = c.update_and_fetch(k[:, :, :2], v[:, :, :2])  # fewer tokens than sinks
    assert c.sink_len == 2 and wk.shape[2] == 2
    c.update_and_fetch(k[:, :, 2:12], v[:, :, 2:12])
    for t in range(12, 20):  # decode, window 0: every older token but the sinks is packed
        wk, wv = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert (c.sink_len, c.packed_len, c.offset) == (3, 20 - 3 - 1, 20)
    assert mx.array_equal(wk, mx.concatenate([k[:, :, :3], k[:, :, 19:]], axis=2))
    assert mx.array_equal(wv, mx.concatenate([v[:, :, :3], v[:, :, 19:]], axis=2))
    # packed token j is token 3 + j: the sinks left the mean and the codes alone
    from turboquant.cache import shrunk_mean

    assert mx.allclose(c.key_mean, shrunk_mean(k[:, :, 3:12], axis=2), atol=1e-6)
    kh = c.key_codec.dequantize(c.keys_packed[:, :, :16], c.keys_norms[:, :, :16]) + c.key_mean
    cos = (kh * k[:, :, 3:19]).sum(-1) / (mx.linalg.norm(kh, axis=-1) * mx.linalg.norm(k[:, :, 3:19], axis=-1))
    assert cos.min().item() > 0.97
    # trim within the packed region keeps the sinks; into the sinks drops the history
    assert c.trim(6) == 6
    assert (c.sink_len, c.packed_len, c.window_keys.shape[2]) == (3, 11, 3)
    assert mx.array_equal(c.window_keys, k[:, :, :3])
    assert c.trim(12) == 12
    assert (c.offset, c.sink_len, c.packed_len, c.window_keys.shape[2]) == (2, 2, 0, 2)
    wk, _ = c.update_and_fetch(k[:, :, 2:5], v[:, :, 2:5])
    assert mx.array_equal(wk, k[:, :, :5]) and c.packed_len == 0


def test_saved_caches_of_another_format_are_refused(tmp_path):
    """A cache saved by an older tqpipe (no format field: the 3/4 split and
    no sinks) or a newer one is refused by name, never misread."""
    c = TurboQuantKVCache(3, window=4)
    c.update_and_fetch(*kv(L=10))
    c.update_and_fetch(*kv(L=1, seed=1))
    arrays, meta = c.state[:len(TurboQuantKVCache._ARRAYS)], c.meta_state
    assert meta[0] == FORMAT == "tqcache-6"
    old = ("3", "4", "4", "0", "11", "2", "64", "64", "scalar")  # format 1: 9 fields
    two = ("tqcache-2",) + meta[1:11]
    three = ("tqcache-3",) + meta[1:13]  # no block-mean field
    four = ("tqcache-4",) + meta[1:14]  # no key scale
    five = ("tqcache-5",) + meta[1:]  # least-squares value scales: same fields
    for saved, found in ((old, "tqcache-1"), (old[:8], "tqcache-1"), (two, "tqcache-2"), (three, "tqcache-3"),
                         (four, "tqcache-4"), (five, "tqcache-5"), (("tqcache-7",) + meta[1:], "tqcache-7")):
        with pytest.raises(ValueError, match=f"format {found}.*reads tqcache-6.*prefill the document again"):
            TurboQuantKVCache.from_state(arrays, saved)
        with pytest.raises(ValueError, match=f"format {found}"):
            TurboQuantKVCache.from_state(arrays + saved)  # as mlx-lm's load_prompt_cache passes it
    assert TurboQuantKVCache.from_state(arrays, meta).packed_len == c.packed_len
