"""The per-channel key scale: calibrated at the first flush from the queries
attention saw before it, saved with the cache, undone by a rewind."""

import math

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from turboquant.attention.reference import reference_attention
from turboquant.cache import KEY_SCALE_POWER, TurboQuantKVCache
from turboquant.integration import install

D, H_KV, G = 64, 2, 4


def uneven(n: int, profile: mx.array, seed: int, heads: int = H_KV) -> mx.array:
    """[1, heads, n, D] Gaussian rows whose channel j has std ``profile[j]``."""
    mx.random.seed(seed)
    return mx.random.normal((1, heads, n, D)) * profile


# keys strong where queries are weak and the other way round (as outlier
# key channels meet the queries of real models)
U = mx.linspace(-1.5, 1.5, D)
K_STD, Q_STD = mx.exp(U), mx.exp(-U)


def prefilled(observe: bool, n: int = 400, window: int = 0) -> TurboQuantKVCache:
    """A cache after one chunk of ``n`` tokens (its queries observed or not)
    and a one-token step, whose update flushes the chunk."""
    c = TurboQuantKVCache(3.5, window=window)
    c.update_and_fetch(uneven(n, K_STD, 0), uneven(n, mx.ones(D), 1))
    if observe:
        c.observe_queries(uneven(n, Q_STD, 2, H_KV * G))
    c.update_and_fetch(uneven(1, K_STD, 3), uneven(1, mx.ones(D), 4))
    return c


def test_no_queries_seen_leaves_the_keys_unscaled():
    assert prefilled(observe=False).key_scale is None


def test_scale_follows_key_over_query_energy_at_geometric_mean_one():
    s = prefilled(observe=True).key_scale
    assert s.shape == (1, H_KV, 1, D)
    log_s2 = mx.log(s * s)[0, :, 0]
    assert mx.abs(log_s2.mean(axis=-1)).max().item() < 1e-4  # geometric mean 1 per head
    # log s^2 = power * log(E k^2 / E q^2) + const = power * 4 u + const
    want = KEY_SCALE_POWER * 4 * U
    want = want - want.mean()
    assert mx.abs(log_s2 - want).max().item() < 0.15


def attention_error(cache: TurboQuantKVCache) -> float:
    """Relative error of the decode step's attention against exact attention
    over the same tokens, for queries of the calibrated profile."""
    q = uneven(1, Q_STD, 5, H_KV * G) * 3.0
    wk, wv = cache.window_keys, cache.window_values
    got = reference_attention(q, wk, wv, cache, D**-0.5)
    keys = mx.concatenate([uneven(400, K_STD, 0), uneven(1, K_STD, 3)], axis=2)
    values = mx.concatenate([uneven(400, mx.ones(D), 1), uneven(1, mx.ones(D), 4)], axis=2)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5)
    return (mx.linalg.norm(got - want) / mx.linalg.norm(want)).item()


def test_the_scale_cuts_the_attention_error_where_channels_are_uneven():
    """In theory (Σ a s²)(Σ b / s²) against (Σ a)(Σ b): 0.18x the score MSE
    here; the output's error (the values' included) is about 0.65x."""
    scaled, plain = attention_error(prefilled(observe=True)), attention_error(prefilled(observe=False))
    assert scaled < 0.75 * plain


def test_saved_and_loaded_caches_keep_the_scale_and_the_pending_query_energy(tmp_path):
    install()  # registers the class with mlx_lm.models.cache for loading
    done = prefilled(observe=True, window=8)
    path = str(tmp_path / "a.safetensors")
    save_prompt_cache(path, [done])
    (back,) = load_prompt_cache(path)
    assert mx.array_equal(back.key_scale, done.key_scale) and back.query_rows == 0
    assert done.used_nbytes == back.used_nbytes and done.used_nbytes > done.key_scale.nbytes

    # saved before its first flush: the loaded cache calibrates as the original does
    pending = TurboQuantKVCache(3.5, window=8)
    pending.update_and_fetch(uneven(100, K_STD, 0), uneven(100, mx.ones(D), 1))
    pending.observe_queries(uneven(100, Q_STD, 2, H_KV * G))
    save_prompt_cache(path, [pending])
    (back,) = load_prompt_cache(path)
    assert back.query_rows == pending.query_rows == 100 * G
    for c in (pending, back):
        c.update_and_fetch(uneven(1, K_STD, 3), uneven(1, mx.ones(D), 4))
    assert back.key_scale is not None and mx.array_equal(back.key_scale, pending.key_scale)


def test_restore_to_before_the_first_flush_forgets_the_scale():
    """A document shorter than the window: its first task's flush must not
    leave a scale (from the task's queries) for the next task."""
    c = TurboQuantKVCache(3.5, window=8)
    c.update_and_fetch(uneven(6, K_STD, 0), uneven(6, mx.ones(D), 1))
    c.observe_queries(uneven(6, Q_STD, 2, H_KV * G))
    mark = c.checkpoint()
    for step in range(2):
        c.observe_queries(uneven(20, mx.ones(D), 10, H_KV * G))
        c.update_and_fetch(uneven(20, K_STD, 20), uneven(20, mx.ones(D), 30))
        c.update_and_fetch(uneven(1, K_STD, 40), uneven(1, mx.ones(D), 41))
        assert c.key_scale is not None
        first = c.key_scale if step == 0 else first
        assert mx.array_equal(c.key_scale, first)  # the same inputs after the rewind: the same scale
        c.restore(mark)
        assert c.key_scale is None and c.query_rows == 6 * G and c.packed_len == 0
    assert math.isclose(mx.exp(mx.log(first * first).mean(axis=-1)).max().item(), 1.0, rel_tol=1e-4)
