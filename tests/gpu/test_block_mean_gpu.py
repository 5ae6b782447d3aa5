"""Caches centred on a block mean (keys after RoPE, their pre-RoPE mean
turned and averaged per block of 32 packed tokens) on a GPU: every kernel
route adds the block's score term back and equals the reference path."""

from __future__ import annotations

import mlx.core as mx
import pytest
from packed_fixtures import filled_cache, rel

from turboquant.attention import Route, device, step_plan, turboquant_attention
from turboquant.attention.compose import dequant_sdpa_attention, split_k_attention
from turboquant.attention.reference import reference_attention
from turboquant.masks import as_5d, split_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(device.backend() is None, reason="needs a GPU backend")]
CUDA = device.backend() == "cuda"


def _cache(kv_bits, d, h_kv, n, L, seed=0):
    cache = filled_cache(kv_bits, d, h_kv, n, seed=seed, block_mean=True)
    k = mx.random.normal((1, h_kv, L, d)) + 0.5
    wk, wv = cache.update_and_fetch(k, k * 0.5)
    assert cache.key_mean_pre is not None and cache.mean_blocks and cache.packed_len % 32
    return cache, wk, wv


@pytest.mark.parametrize("kv_bits", [2.5, 3.5, 4])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("route,L", [(Route.SIMT, 1), (Route.TC8, 1), (Route.TC8, 2), (Route.TC, 40)])
def test_split_k_routes_add_the_block_bias(monkeypatch, kv_bits, d, route, L):
    if route is not Route.SIMT and not CUDA:
        pytest.skip("tensor-core kernels are CUDA only")
    h_kv, g = 2, 4
    cache, wk, wv = _cache(kv_bits, d, h_kv, 2000, L)
    q = mx.random.normal((1, h_kv * g, L, d)) * 2.0
    mask = "causal" if L > 1 else None
    _, wmask = split_mask(mask, L, cache.packed_len, wk.shape[2], cache.sink_len)
    wmask = None if wmask is None else as_5d(wmask, 1, h_kv, g)  # as the dispatch hands it over
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    got = split_k_attention(q, wk, wv, cache, d**-0.5, wmask, route)
    ref = reference_attention(q, wk, wv, cache, d**-0.5, mask)
    assert rel(got, ref) < (6e-3 if route is not Route.SIMT else 2e-3)
    # the term matters: without it the same codes give another answer
    cache.mean_blocks = False
    assert rel(reference_attention(q, wk, wv, cache, d**-0.5, mask), ref) > 3e-2


@pytest.mark.skipif(not CUDA, reason="the fused step is CUDA only")
@pytest.mark.parametrize("kv_bits", [2.5, 3.5, 4])
@pytest.mark.parametrize("d,h_kv,g,L", [(128, 2, 4, 1), (64, 2, 1, 1), (128, 1, 8, 1), (128, 2, 2, 2)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_step_adds_the_block_bias(monkeypatch, kv_bits, d, h_kv, g, L, dtype):
    dt = getattr(mx, dtype)
    cache = filled_cache(kv_bits, d, h_kv, 3000, block_mean=True)
    k = mx.random.normal((1, h_kv, L, d)) + 0.5
    wk, wv = cache.update_and_fetch(k.astype(dt), (k * 0.5).astype(dt))
    q = (mx.random.normal((1, h_kv * g, L, d)) * 2.0).astype(dt)
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    fused = step_plan.decode_step(q, wk, wv, cache, d**-0.5)
    ops = split_k_attention(q, wk, wv, cache, d**-0.5, None, Route.TC8)
    ref = reference_attention(q, wk, wv, cache, d**-0.5, None)
    tol = {"float16": 6e-3, "bfloat16": 1.2e-2}[dtype]
    assert rel(fused, ops) < tol and rel(fused, ref) < tol
    # and through the dispatch, which takes the fused step for this call
    assert rel(turboquant_attention(q, wk, wv, cache, d**-0.5, None), ref) < tol


@pytest.mark.parametrize("n", [40, 700, 20000])
def test_dequant_sdpa_adds_each_blocks_mean(monkeypatch, n):
    """The dequantize kernel adds one mean per block of 32 tokens (prefill
    chunks of 1,024+ rows per kv head take this route on CUDA)."""
    d, h_kv, g, L = 128, 2, 4, 48
    cache = filled_cache(3.5, d, h_kv, n, window=0, block_mean=True)
    k = mx.random.normal((1, h_kv, L, d)) + 0.5
    wk, wv = cache.update_and_fetch(k, k * 0.5)
    q = mx.random.normal((1, h_kv * g, L, d))
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    got = dequant_sdpa_attention(q, wk, wv, cache, d**-0.5, "causal")
    ref = reference_attention(q, wk, wv, cache, d**-0.5, "causal")
    assert rel(got, ref) < 6e-3


@pytest.mark.parametrize("L", [1, 64, 1100])
def test_attention_over_a_long_block_mean_history_matches_the_reference(monkeypatch, L):
    """Whichever route the dispatch picks (fused step, tc, dequantize +
    SDPA), over ~10k tokens whose last block is partial."""
    d, h_kv, g = 128, 2, 4
    cache, wk, wv = _cache(3.5, d, h_kv, 10007, L, seed=3)
    q = mx.random.normal((1, h_kv * g, L, d))
    mask = "causal" if L > 1 else None
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    out = turboquant_attention(q, wk, wv, cache, d**-0.5, mask)
    ref = reference_attention(q, wk, wv, cache, d**-0.5, mask)
    assert rel(out, ref) < 6e-3


@pytest.mark.parametrize("rope,d", [("plain", 128), ("partial-traditional", 64)])
@pytest.mark.parametrize("R", [1, 4, 8, 12, 40])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_key_bias_kernel_matches_its_mlx_ops(monkeypatch, rope, d, R, dtype):
    """One launch computes q . mu_b for every (row, block) as the MLX ops do,
    pad rows zero, for a full and a partial (traditional) RoPE."""
    import mlx.nn as nn

    from turboquant.attention import launchers
    from turboquant.rotary import Rotary

    monkeypatch.setenv("TQ_KERNELS", "gpu")
    cache = filled_cache(3.5, d, 2, 3000, block_mean=True)
    if rope != "plain":  # keys from this RoPE instead
        r = nn.RoPE(32, traditional=True, base=10000.0)
        cache.rotary = Rotary.of(r).canonical()
    k = mx.random.normal((1, 2, 1, d))
    cache.update_and_fetch(k, k)
    q = mx.random.normal((1, 2, R, d)).astype(getattr(mx, dtype))
    for n in (cache.packed_len, 33, 32):
        got = launchers.key_bias(cache, q, n, 0.3)
        want = launchers.key_bias_ops(cache, q, n, 0.3)
        assert got.shape == want.shape == (2, -(-n // 32), -(-R // 8) * 8)
        # (the ops' product runs through MLX's GPU matmul: TF32 on NVIDIA)
        assert rel(got, want) < 2e-3 and not mx.any(got[..., R:]).item()


@pytest.mark.skipif(not CUDA, reason="the fused step is CUDA only")
def test_a_cache_turning_more_pairs_than_the_compact_table_takes_tc8(monkeypatch):
    """Every pair turned (a cache made with ``mean_pairs`` 0, e.g. loaded
    from elsewhere): the fused step declines and tc8 with the key-bias
    kernel's full table gives the reference's answer."""
    d, h_kv, g = 128, 2, 4
    cache = filled_cache(3.5, d, h_kv, 2000, block_mean=True)
    cache.mean_pairs = 0
    k = mx.random.normal((1, h_kv, 1, d)) + 0.5
    wk, wv = cache.update_and_fetch(k, k * 0.5)
    assert cache.turned_pairs is None
    q = mx.random.normal((1, h_kv * g, 1, d))
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    assert step_plan.fused_step(q, wk, wv, cache, d**-0.5) is None
    ref = reference_attention(q, wk, wv, cache, d**-0.5, None)
    assert rel(turboquant_attention(q, wk, wv, cache, d**-0.5, None), ref) < 6e-3


@pytest.mark.parametrize("route", ["fused", Route.TC8, Route.TC, "dequant"])
def test_key_scaled_cache_on_every_route(monkeypatch, route):
    """A cache whose packed keys hold keys / key_scale (fixed at the first
    flush from the queries seen): each kernel route multiplies the queries
    by the scale against the codes, and equals the reference path."""
    if not CUDA:
        pytest.skip("tensor-core kernels and the fused step are CUDA only")
    d, h_kv, g = 128, 2, 4
    L = {"fused": 1, Route.TC8: 2, Route.TC: 40, "dequant": 48}[route]
    cache = filled_cache(3.5, d, h_kv, 3000, block_mean=True)
    cache.observe_queries(mx.random.normal((1, h_kv * g, 16, d)) * mx.linspace(0.2, 3.0, d))
    k = mx.random.normal((1, h_kv, L, d)) + 0.5
    wk, wv = cache.update_and_fetch(k.astype(mx.bfloat16), (k * 0.5).astype(mx.bfloat16))
    assert cache.key_scale is not None
    q = (mx.random.normal((1, h_kv * g, L, d)) * 2.0).astype(mx.bfloat16)
    mask = "causal" if L > 1 else None
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    ref = reference_attention(q, wk, wv, cache, d**-0.5, mask)
    if route == "fused":
        got = step_plan.decode_step(q, wk, wv, cache, d**-0.5)
    elif route == "dequant":
        got = dequant_sdpa_attention(q, wk, wv, cache, d**-0.5, mask)
    else:
        _, wmask = split_mask(mask, L, cache.packed_len, wk.shape[2], cache.sink_len)
        wmask = None if wmask is None else as_5d(wmask, 1, h_kv, g)
        got = split_k_attention(q, wk, wv, cache, d**-0.5, wmask, route)
    assert rel(got, ref) < 1.2e-2
