"""The kernels on a GPU against float64 / the reference path (skipped without Metal or CUDA).

Every kernel is compared with a reference computed from the same packed
data.  Launch shapes other than the table's are function arguments.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from packed_fixtures import filled_cache, packed_tensor, reference_decode, rel

from turboquant.attention import Route, device, table, turboquant_attention
from turboquant.attention.launchers import decode, dequantize, quantize
from turboquant.attention.reference import reference_attention
from turboquant.codebooks import codebook
from turboquant.codec import TurboQuantCodec
from turboquant.packing import unpack
from turboquant.rotation import HadamardRotation

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(device.backend() is None, reason="needs an Apple (Metal) or NVIDIA (CUDA) GPU")]
WIDTHS = [(2, 2), (3, 2), (3, 3), (4, 3), (4, 4), (2, 3), (3, 4)]  # presets 2, 2.5, 3, 3.5, 4; other splits


def cuda_only():
    if device.backend() != "cuda":
        pytest.skip("tensor-core kernel: CUDA only")


def check_decode(rng, bk, bv, B, H, cap, n, rows, q_scale, route, structured_keys=False, d=128, **shape):
    """``decode`` on random packed K/V (head dim d) against the float64
    reference: output within 4e-3, log-sum-exp within 4e-2 (fp16 operands)."""
    kw, kn, ik = packed_tensor(rng, B, H, cap, d, bk, n, structured=structured_keys)
    vw, vn, iv = packed_tensor(rng, B, H, cap, d, bv, n)
    ck = np.asarray(codebook(bk, d).centroids)
    cv = np.asarray(codebook(bv, d).centroids)
    q = rng.standard_normal((B, H, rows, d)) * q_scale
    out, lse = decode(mx.array(q.astype(np.float32)), kw, kn, vw, vn, mx.array(ck.astype(np.float32)),
                      mx.array(cv.astype(np.float32)), n, bk, bv, route, **shape)
    ro, rl = reference_decode(q, ik, np.asarray(kn), iv, np.asarray(vn), ck, cv, n)
    assert rel(out, ro) < 4e-3
    assert np.abs(np.asarray(lse) - rl).max() < 4e-2 * max(1.0, np.abs(rl).max())


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("route", [Route.SIMT, Route.TC, Route.TC8])
def test_decode_matches_reference(bits, d, gqa, route):
    """SIMT kernel (fp32 throughout): 2e-5 of float64.  Tensor-core kernels
    (CUDA, d 64/128): fp16 operands with fp32 accumulation, like fp16 SDPA,
    so ~1e-3; 4e-3 bounds it."""
    if route is not Route.SIMT and (device.backend() != "cuda" or d not in (64, 128)):
        pytest.skip("tensor-core kernel: CUDA, head dim 64/128")
    tol = 2e-5 if route is Route.SIMT else 4e-3
    bk, bv = bits
    rng = np.random.default_rng(d * 100 + gqa * 10 + bk)
    B, H, L = 1, 2, 1 if gqa > 1 else 2
    for n, cap, structured in ((1, 16, False), (3001, 3100, False), (4096, 4096, True)):
        kw, kn, ik = packed_tensor(rng, B, H, cap, d, bk, n, structured)
        vw, vn, iv = packed_tensor(rng, B, H, cap, d, bv, n, structured)
        ck = np.asarray(codebook(bk, d).centroids)
        cv = np.asarray(codebook(bv, d).centroids)
        q = rng.standard_normal((B, H, gqa * L, d)) * (4.0 if structured else 1.0)
        out, lse = decode(mx.array(q.astype(np.float32)), kw, kn, vw, vn, mx.array(ck.astype(np.float32)),
                          mx.array(cv.astype(np.float32)), n, bk, bv, route)
        ro, rl = reference_decode(q, ik, np.asarray(kn), iv, np.asarray(vn), ck, cv, n)
        assert rel(out, ro) < tol, (n, structured)
        assert np.abs(np.asarray(lse) - rl).max() < 10 * tol * max(1.0, np.abs(rl).max())


@pytest.mark.parametrize("bits", [(4, 3), (3, 2), (3, 4), (2, 3)])
@pytest.mark.parametrize("rows", [9, 40, 256])
def test_tensor_core_kernel_tiles_many_query_rows(bits, rows):
    """Prefill chunks: rows in tiles of 16 (the last one partial), one grid row per tile."""
    cuda_only()
    bk, bv = bits
    check_decode(np.random.default_rng(rows), bk, bv, B=1, H=2, cap=3072, n=3001, rows=rows, q_scale=2.0,
                 route=Route.TC)


@pytest.mark.parametrize("bits", [(4, 3), (3, 2), (3, 4), (2, 3), (4, 4)])
@pytest.mark.parametrize("blocks,nw", [(2, 8), (64, 4), (64, 8)])
def test_tc8_long_splits_and_fused_reduction(bits, blocks, nw):
    """tc8 with few threadgroups (each warp loops over many chunks) and with
    many (the last threadgroup of a head merges 20+ partials), 4 and 8 warps."""
    cuda_only()
    bk, bv = bits
    check_decode(np.random.default_rng(20000 + bk), bk, bv, B=2, H=2, cap=20480, n=20000, rows=4,
                 q_scale=3.0, route=Route.TC8, structured_keys=True, blocks=blocks, warps=nw)


@pytest.mark.parametrize("n", [5, 16, 100, 129, 1000, 3001])
@pytest.mark.parametrize("nw", [4, 8])
def test_tc8_every_tile_count_per_warp(n, nw):
    """With the shortest splits: warps with no first chunk, a last chunk
    drawn by position or from the counter, a partial chunk of 5-31 tokens or
    none; the edge tile masks tokens, not positions."""
    cuda_only()
    cap = -(-n // 256) * 256
    check_decode(np.random.default_rng(n), 3, 4, B=1, H=2, cap=cap, n=n, rows=4, q_scale=2.0,
                 route=Route.TC8, blocks=4096, warps=nw)


@pytest.mark.parametrize("rising", [True, False])
@pytest.mark.parametrize("nw", [4, 8])
def test_tc8_running_max_that_rises_every_tile(rising, nw):
    """tc8 skips the cross-lane row max unless a lane's score beats the
    running max.  Key norms that grow along the sequence (x60) make the max
    rise in nearly every tile; falling norms leave the first tile's max."""
    cuda_only()
    rng = np.random.default_rng(7)
    B, H, n, d, bk, bv = 1, 2, 6000, 128, 3, 4
    kw, _, ik = packed_tensor(rng, B, H, n, d, bk, n)
    vw, vn, iv = packed_tensor(rng, B, H, n, d, bv, n)
    ramp = np.linspace(0.1, 6.0, n) if rising else np.linspace(6.0, 0.1, n)
    kn = np.broadcast_to(ramp, (B, H, n)).astype(np.float16)
    ck = np.asarray(codebook(bk, d).centroids)
    cv = np.asarray(codebook(bv, d).centroids)
    q = rng.standard_normal((B, H, 4, d)) * 2.0
    out, lse = decode(mx.array(q.astype(np.float32)), kw, mx.array(kn), vw, vn, mx.array(ck.astype(np.float32)),
                      mx.array(cv.astype(np.float32)), n, bk, bv, Route.TC8, blocks=4, warps=nw)
    ro, rl = reference_decode(q, ik, kn, iv, np.asarray(vn), ck, cv, n)
    assert rel(out, ro) < 4e-3
    assert np.abs(np.asarray(lse) - rl).max() < 4e-2 * max(1.0, np.abs(rl).max())


def test_tc8_merge_of_more_splits_than_shared_memory_weighs_at_once():
    """Head dim 64 at 2 bits with 4 warps leaves shared memory for the split
    weights of 262 splits; one kv head over 40,000 tokens in threadgroups
    of 128 tokens has 313, so the last threadgroup merges them in two blocks."""
    cuda_only()
    d, n = 64, 40000
    assert table.tc8_config(d, 4, 1, n, 2, 2, blocks=1056, warps=4)["S"] == 313
    check_decode(np.random.default_rng(64), 2, 2, B=1, H=1, cap=n, n=n, rows=4, q_scale=3.0, d=d,
                 route=Route.TC8, blocks=1056, warps=4)


def _long_history(n: int, L: int):
    from turboquant.cache import TurboQuantKVCache

    d, h_kv, g = 128, 8, 4
    cache = TurboQuantKVCache(3.5, seed=0)
    cache.reserve(n + L)
    for a in range(0, n, 8192):
        x = mx.random.normal((1, h_kv, 8192, d)).astype(mx.float16)
        cache.update_and_fetch(x, x)
        mx.eval(cache.keys_packed, cache.values_packed)
    x = mx.random.normal((1, h_kv, L, d)).astype(mx.float16)
    wk, wv = cache.update_and_fetch(x, x)
    q = mx.random.normal((1, h_kv * g, L, d)).astype(mx.float16)
    mx.eval(wk, wv, q)
    return cache, q, wk, wv, 2 * h_kv * cache.packed_len * d * 2  # fp16 keys + values


def _peak_of(call) -> int:
    mx.eval(call())  # one-time allocations
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(call())
    return mx.get_peak_memory() - before


def test_prefill_memory_by_route(monkeypatch):
    """Over a long packed history a chunk below PREFILL_SDPA_ROWS reads the
    codes in place (peak far below the dequantized history); a longer chunk
    dequantizes it for one SDPA, a temporary bounded by the route's own
    estimate; past PREFILL_DEQUANT_BYTES it reads the codes in place again."""
    cuda_only()
    from turboquant.attention.route import describe, dequant_bytes

    monkeypatch.setattr(table, "WINDOW_SCORES_BYTES", 8 << 20)  # the chunk's own scores, blocked
    d = 128
    short_rows = table.PREFILL_SDPA_ROWS // 2
    cache, q, wk, wv, dequantized = _long_history(131072, short_rows // 4)
    assert _peak_of(lambda: turboquant_attention(q, wk, wv, cache, d**-0.5, "causal")) < dequantized / 4

    cache, q, wk, wv, dequantized = _long_history(131072, 512)  # 2,048 rows per kv head
    c = describe(q, wk, wv, cache, None, None, None, True)
    assert c.rows >= table.PREFILL_SDPA_ROWS and dequant_bytes(c) <= table.PREFILL_DEQUANT_BYTES
    peak = _peak_of(lambda: turboquant_attention(q, wk, wv, cache, d**-0.5, "causal"))
    assert dequantized / 2 < peak <= dequant_bytes(c) * 1.1
    monkeypatch.setattr(table, "PREFILL_DEQUANT_BYTES", dequant_bytes(c) - 1)
    assert _peak_of(lambda: turboquant_attention(q, wk, wv, cache, d**-0.5, "causal")) < dequantized / 4


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dequant_matches_codec(bits, d):
    rng = np.random.default_rng(bits + d)
    B, H, cap, n = 2, 3, 300, 257
    words, norms, idx = packed_tensor(rng, B, H, cap, d, bits, n)
    c = np.asarray(codebook(bits, d).centroids)
    mean = rng.standard_normal((B, H, d)).astype(np.float32)
    out = dequantize(words, norms, mx.array(c.astype(np.float32)), n, bits, d, mx.float32, mx.array(mean))
    ref = c[idx[:, :, :n]] * np.asarray(norms)[:, :, :n, None].astype(np.float64) + mean[:, :, None]
    assert out.shape == (B, H, n, d)
    assert rel(out, ref) < 1e-6
    half = dequantize(words, norms, mx.array(c.astype(np.float32)), n, bits, d, mx.float16)
    assert half.dtype == mx.float16
    assert rel(half, ref - mean[:, :, None]) < 1e-3


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("unbiased", [False, True])
def test_quantize_matches_codec(bits, d, dtype, unbiased):
    """Bit-identical except where float rounding decides: a coordinate at a
    cell boundary, or two scales of the search that fit a vector equally
    well.  So rows may differ only rarely, and a row that differs must fit
    about as well as the reference's (⟨u, ĉ⟩² / ‖ĉ‖², what the search
    maximises).  "About": one coordinate moved across a boundary changes the
    fit by ~2tΔ/‖ĉ‖² · |‖ĉ‖²/(α⟨u, ĉ⟩) - 1| (t the boundary, Δ the cell
    width), up to ~1e-3 at these widths (float16 inputs round the rotated
    coordinates differently on the two sides)."""
    codec = TurboQuantCodec(d, bits, HadamardRotation(d, seed=7), unbiased=unbiased)
    mx.random.seed(bits * d)
    x = (mx.random.normal((3, 5, 64, d)) * 2.0).astype(dtype)
    x[0, 0, 0] = 0.0  # zero vector: index of 0, norm 0
    packed, norms = quantize(x, codec)
    ref_p, ref_n = codec.quantize(x)
    assert packed.shape == ref_p.shape and packed.dtype == mx.uint32
    got, want = np.asarray(unpack(packed, bits, d)), np.asarray(unpack(ref_p, bits, d))
    rows_differ = (got != want).any(-1)
    assert rows_differ.mean() < 1e-2
    y = np.asarray(codec.rotation.forward(x.astype(mx.float32)), np.float64)
    u = y / np.maximum(np.linalg.norm(y, axis=-1, keepdims=True), 1e-30)
    cents = np.asarray(codec.codebook.centroids, np.float64)

    def fit(idx):
        c = cents[idx]
        return (u * c).sum(-1) ** 2 / (c * c).sum(-1)

    assert np.all(fit(got) >= fit(want) * (1 - 2e-3) - 1e-9)
    rows_same = ~rows_differ
    np.testing.assert_allclose(np.asarray(norms, np.float32)[rows_same], np.asarray(ref_n, np.float32)[rows_same],
                               rtol=1e-3)


@pytest.mark.parametrize("kv_bits", [2.5, 3.5, 4])
@pytest.mark.parametrize("L", [1, 64])
def test_attention_matches_reference_path(monkeypatch, kv_bits, L):
    """Whole attention (packed + window, centring, GQA, causal mask) equals the reference."""
    d, h_kv, g = 128, 2, 4
    cache = filled_cache(kv_bits, d, h_kv, 700)
    k = mx.random.normal((1, h_kv, L, d))
    wk, wv = cache.update_and_fetch(k, k * 0.5)
    assert cache.packed_len > 0
    q = mx.random.normal((1, h_kv * g, L, d))
    mask = "causal" if L > 1 else None
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    out = turboquant_attention(q, wk, wv, cache, d**-0.5, mask)
    ref = reference_attention(q, wk, wv, cache, d**-0.5, mask)
    # Both paths run their dense float32 products through MLX's GPU matmuls
    # (TF32 on NVIDIA: 4-5e-4 apart); the packed part alone is checked to
    # 2e-5 in test_decode_matches_reference.  On CUDA the tensor-core
    # kernels (fp16 operands) serve both L=1 and L=64.
    assert rel(out, ref) < (6e-3 if device.backend() == "cuda" else 2e-3)
