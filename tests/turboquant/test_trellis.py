"""Trellis-coded quantization (turboquant.trellis): encoder optimality, tables,
MSE gain over the scalar codec, layout, cache/attention plumbing, centring."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from packed_fixtures import close, dense_reference
from tiny_models import prompt_tokens, tiny_llama
from turboquant import TurboQuantKVCache, make_prompt_cache
from turboquant.attention import Route, choose
from turboquant.attention.launchers import supports_quantize
from turboquant.policy import SINK_TOKENS
from turboquant.attention.route import describe
from turboquant.attention import turboquant_attention
from turboquant.cache import shrunk_mean
from turboquant.codec import TurboQuantCodec
from turboquant.integration import install
from turboquant.rotation import HadamardRotation
from turboquant.trellis import TrellisCodec, parity_bits, parity_table, reconstruct, viterbi
from turboquant.trellis_tables import CODEBOOKS, START_OFFSETS, STATES_LOG2, TAPS


def ref_decode(idx: np.ndarray, levels: np.ndarray, taps: int, nu: int, offsets=None) -> np.ndarray:
    """Sequential state-machine decode (independent of the vectorised one)."""
    out = np.empty(idx.shape, np.float64)
    off = np.zeros(idx.shape[-1]) if offsets is None else np.asarray(offsets, np.float64)
    par = parity_table(taps, nu)
    for row in range(idx.shape[0]):
        s = 0
        for i, ix in enumerate(idx[row]):
            out[row, i] = levels[2 * int(ix) + int(par[s])] - off[i]
            s = ((s << 1) | (int(ix) & 1)) & ((1 << nu) - 1)
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_viterbi_is_optimal_by_brute_force(k):
    d, nu, taps = 8, 3, 0b101
    rng = np.random.default_rng(k)
    levels = np.sort(rng.standard_normal(1 << (k + 1)))
    allseq = np.array(list(itertools.product(range(1 << k), repeat=d)))  # [(2^k)^d, d]
    u = rng.standard_normal((16, d)) * 0.8
    for off in (None, 0.3 * rng.standard_normal(d)):
        rec = ref_decode(allseq, levels, taps, nu, off)
        best = ((u[:, None, :] - rec[None]) ** 2).sum(-1).min(axis=1)
        idx = np.array(viterbi(mx.array(u.astype(np.float32)), levels, taps, nu, off))
        got = ((u - ref_decode(idx, levels, taps, nu, off)) ** 2).sum(-1)
        np.testing.assert_allclose(got, best, rtol=1e-5, atol=1e-6)
        # and the vectorised decoder agrees with the sequential one
        np.testing.assert_allclose(np.array(reconstruct(mx.array(idx), levels, taps, off)),
                                   ref_decode(idx, levels, taps, nu, off), rtol=1e-5, atol=1e-6)


def test_tables_consistent_and_levels_are_centroids():
    assert 0 < TAPS < (1 << STATES_LOG2) and TAPS >> (STATES_LOG2 - 1) == 1
    for k, C in CODEBOOKS.items():
        C = np.asarray(C)
        assert len(C) == 1 << (k + 1) and len(START_OFFSETS[k]) == STATES_LOG2
        for q in range(4):  # the encoder's nearest-level search needs this
            assert np.all(np.diff(C[q::4]) > 0)
        if k >= 2:  # the widths the cache uses have a sorted union codebook
            assert np.all(np.diff(C) > 0)
        # symmetric: the CPU decoder looks up |C| in a half-size tree plus a sign
        np.testing.assert_allclose(C, -C[::-1], rtol=0, atol=1e-12)
    # Symmetric generalized-Lloyd fixed point on a fresh N(0,1) set: each
    # mirrored pair of levels is the least-squares point of both cells
    # (sampling noise ~0.005).
    X = np.random.default_rng(123).standard_normal((512, 128)).astype(np.float32)
    for k in (2, 3):
        C = np.asarray(CODEBOOKS[k])
        off = np.zeros(128)
        off[:STATES_LOG2] = START_OFFSETS[k]
        idx = viterbi(mx.array(X), C, TAPS, STATES_LOG2, off)
        code = np.array((idx << 1) | parity_bits(idx & 1, TAPS)).astype(np.int64)
        cnt = np.bincount(code.ravel(), minlength=len(C))
        xo = (X + off).ravel().astype(np.float64)  # the levels quantize x + offsets
        mean = np.bincount(code.ravel(), weights=xo, minlength=len(C))
        ok = cnt > 200
        assert ok.sum() >= len(C) - 2
        pair = (mean - mean[::-1]) / np.maximum(cnt + cnt[::-1], 1)
        np.testing.assert_allclose(pair[ok], C[ok], atol=0.03)
        # and the offsets remove the mean error at the start positions
        err = (C[code] - off) - X
        assert np.abs(err[:, :STATES_LOG2].mean(axis=0)).max() < 0.03


def unit_mse(codec, n=1024, seed=0):
    x = mx.random.normal((n, codec.dim), key=mx.random.key(seed))
    x = x / mx.linalg.norm(x, axis=-1, keepdims=True)
    return float(((codec.dequantize(*codec.quantize(x)) - x) ** 2).sum(-1).mean())


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_unit_mse_well_below_the_scalar_codec(bits):
    rot = HadamardRotation(128, 3)
    tcq, scalar = unit_mse(TrellisCodec(128, bits, rot)), unit_mse(TurboQuantCodec(128, bits, rot))
    # measured 0.72-0.75x (docs/benchmarks.md); the goal needs <= 0.8
    assert tcq <= 0.85 * scalar, (bits, tcq, scalar)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_layout_bytes_and_decode_match_reference(bits):
    rot = HadamardRotation(64, 7)
    tcq, scalar = TrellisCodec(64, bits, rot), TurboQuantCodec(64, bits, rot)
    x = mx.random.normal((2, 3, 5, 64), key=mx.random.key(bits)) * 3
    qt, qs = tcq.quantize(x), scalar.quantize(x)
    assert qt.packed.shape == qs.packed.shape and qt.packed.dtype == qs.packed.dtype == mx.uint32
    assert qt.norms.shape == qs.norms.shape and qt.norms.dtype == qs.norms.dtype == mx.float16
    assert tcq.bytes_per_vector == scalar.bytes_per_vector and tcq.words == scalar.words
    from turboquant.packing import unpack

    idx = np.array(unpack(qt.packed, bits, 64)).reshape(-1, 64)
    levels = np.asarray(tcq.levels, np.float64)
    ref = ref_decode(idx, levels, tcq.taps, tcq.states_log2, tcq.offsets).reshape(2, 3, 5, 64)
    ref = ref * np.array(qt.norms.astype(mx.float32))[..., None]
    np.testing.assert_allclose(np.array(tcq.dequantize_rotated(*qt)), ref, rtol=1e-6, atol=1e-7)
    back = tcq.dequantize(*qt)
    close(back, rot.inverse(tcq.dequantize_rotated(*qt)), 1e-5)
    rel = float(mx.linalg.norm(back - x) / mx.linalg.norm(x))
    assert rel < {2: 0.35, 3: 0.2, 4: 0.11}[bits]
    assert "TrellisCodec(dim=64" in repr(tcq)


def test_codec_errors_are_clear():
    with pytest.raises(ValueError, match="states_log2"):
        TrellisCodec(64, 3, states_log2=STATES_LOG2 + 2)
    with pytest.raises(ValueError, match="bits"):
        TrellisCodec(64, 5)


def tcq_cache(bits=3.5, H_kv=2, D=64, n=150, L=3, window=16, seed=0):
    mx.random.seed(seed)
    bias = 3.0 * mx.random.normal((1, H_kv, 1, D))
    c = TurboQuantKVCache(bits, window=window, seed=seed, quantizer="tcq")
    c.update_and_fetch(mx.random.normal((1, H_kv, n, D)) + bias, mx.random.normal((1, H_kv, n, D)))
    wk, wv = c.update_and_fetch(mx.random.normal((1, H_kv, L, D)) + bias,
                                mx.random.normal((1, H_kv, L, D)))
    return c, wk, wv


@pytest.mark.parametrize("mask", [None, "causal"])
def test_attention_on_tcq_cache_equals_dense_on_dequantized(mask):
    c, wk, wv = tcq_cache()
    assert isinstance(c.key_codec, TrellisCodec) and c.packed_len == 150 - 16 - SINK_TOKENS
    q = mx.random.normal((1, 8, 3, 64))
    out = turboquant_attention(q, wk, wv, c, scale=0.125, mask=mask)
    close(out, dense_reference(q, c, wk, wv, 0.125, mask))
    # the kernels decode scalar codes only: TCQ caches take the reference route on every device
    call = describe(q, wk, wv, c, None, None, None, True)
    assert choose(call, "cuda", "gpu") is Route.REFERENCE and choose(call, "metal", "gpu") is Route.REFERENCE
    assert not supports_quantize(c.key_codec)


def test_tcq_cache_save_load_round_trip(tmp_path):
    install()
    c, _, _ = tcq_cache(bits=2.5, n=40, L=2, window=5)
    path = str(tmp_path / "tcq.safetensors")
    save_prompt_cache(path, [c])
    (d,) = load_prompt_cache(path)
    assert d.quantizer == "tcq" and isinstance(d.value_codec, TrellisCodec)
    for a, b in zip(c.state[:len(TurboQuantKVCache._ARRAYS)], d.state[:len(TurboQuantKVCache._ARRAYS)]):
        assert (a is None and b is None) or mx.array_equal(a, b)
    q = mx.random.normal((1, 4, 1, 64))
    nk, nv = mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64))
    wc, wd = c.update_and_fetch(nk, nv), d.update_and_fetch(nk, nv)
    assert mx.array_equal(turboquant_attention(q, *wc, c, 0.125), turboquant_attention(q, *wd, d, 0.125))


def test_saved_quantizer_round_trips_and_bad_quantizer_is_rejected():
    c = TurboQuantKVCache(3, window=4, quantizer="tcq")
    c.update_and_fetch(mx.random.normal((1, 1, 10, 64)), mx.random.normal((1, 1, 10, 64)))
    again = TurboQuantKVCache.from_state(c.state[:len(TurboQuantKVCache._ARRAYS)], c.meta_state)
    assert again.quantizer == "tcq" and isinstance(again.key_codec, TrellisCodec)
    with pytest.raises(ValueError, match="saved quantizer 'vq'"):
        TurboQuantKVCache.from_state(c.state[:len(TurboQuantKVCache._ARRAYS)], c.meta_state[:10] + ("vq",) + c.meta_state[11:])
    with pytest.raises(ValueError, match="scalar.*tcq"):
        TurboQuantKVCache(3, quantizer="vq")
    with pytest.raises(ValueError, match="scalar, tcq"):
        make_prompt_cache(tiny_llama(seed=0), quantizer="lattice")


def test_make_prompt_cache_tcq_generates_end_to_end():
    from mlx_lm.generate import generate_step

    model = tiny_llama(seed=0)
    cache = make_prompt_cache(model, kv_bits=3.5, window=16, quantizer="tcq")
    assert all(c.quantizer == "tcq" for c in cache)
    toks = [int(t) for t, _ in generate_step(prompt_tokens(120), model, prompt_cache=cache,
                                             max_tokens=6, prefill_step_size=64)]
    assert len(toks) == 6 and all(0 <= t < 256 for t in toks)
    assert cache[0].packed_len > 90 and isinstance(cache[0].key_codec, TrellisCodec)


def test_james_stein_centring():
    key = mx.random.key(5)
    x = mx.random.normal((1, 8, 512, 128), key=key)  # zero-mean Gaussian
    raw = mx.mean(x, axis=2, keepdims=True)
    js = shrunk_mean(x)
    # per channel, 1 - 1/chi2_1 survives only where chi2_1 > 1: ~1/3 of the
    # noise energy is left (measured 0.35), most channels get exactly 0
    assert float((js * js).sum()) < 0.45 * float((raw * raw).sum())
    assert float((js == 0).mean()) > 0.6
    assert js.shape == raw.shape
    off = mx.array(np.random.default_rng(0).normal(0, 3.0, (1, 8, 1, 128)).astype(np.float32))
    y = x + off + 20.0 * (mx.arange(128) == 3)  # strong per-channel offsets, one outlier channel
    raw, js = mx.mean(y, axis=2, keepdims=True), shrunk_mean(y)
    strong = mx.abs(raw) > 0.5  # >> sigma/sqrt(n) = 0.044
    rel = mx.abs(js - raw) / mx.abs(raw)
    assert float(mx.where(strong, rel, 0).max()) < 0.01
    assert float(mx.abs(js[..., 3] - raw[..., 3]).max()) < 1e-3


@pytest.mark.parametrize("bits", [2, 3])
def test_reconstruction_error_has_no_common_bias(bits):
    """The error of the rotated unit direction must average out over tokens:
    a bias shared by every vector does not shrink in an attention sum."""
    rot = HadamardRotation(128, 3)
    c = TrellisCodec(128, bits, rot)
    x = mx.random.normal((4096, 128), key=mx.random.key(1))
    y = rot.forward(x / mx.linalg.norm(x, axis=-1, keepdims=True))
    e = np.array(c.dequantize_rotated(*c.quantize_rotated(y)) - y)
    noise = e.std(0) / np.sqrt(len(e))
    # the zero start state left -0.005 at position 0 (11 noise sigmas at 2 bits)
    assert np.abs(e.mean(0) / noise)[:8].max() < 5
