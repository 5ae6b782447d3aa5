"""turboquant_attention (on CPU: the reference route) vs dense attention on the dequantized cache."""

import mlx.core as mx
import pytest

import turboquant.attention.reference as tqa
from packed_fixtures import close, dense_reference
from turboquant.attention import turboquant_attention
from turboquant.cache import TurboQuantKVCache


def filled_cache(bits, H_kv, D, n_first, n_then, window, seed=0, offsets=True, flush_batch=1,
                 quantizer="scalar"):
    """A cache after a prefill of n_first tokens and a chunk of n_then
    (``flush_batch=1``: every token beyond the window is packed at once)."""
    mx.random.seed(seed)
    bias = 3.0 * mx.random.normal((1, H_kv, 1, D)) if offsets else 0.0
    c = TurboQuantKVCache(bits, window=window, seed=seed, flush_batch=flush_batch, quantizer=quantizer)
    k1 = mx.random.normal((1, H_kv, n_first, D)) + bias
    c.update_and_fetch(k1, mx.random.normal((1, H_kv, n_first, D)) + bias)
    k2 = mx.random.normal((1, H_kv, n_then, D)) + bias
    wk, wv = c.update_and_fetch(k2, mx.random.normal((1, H_kv, n_then, D)) - bias)
    return c, wk, wv


@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("L", [1, 7])
@pytest.mark.parametrize("bits", [2.5, 4])
def test_matches_dense_attention_on_dequantized_cache(G, L, bits, monkeypatch):
    monkeypatch.setattr(tqa, "BLOCK", 48)  # several blocks + a ragged tail
    H_kv, D = 2, 64
    c, wk, wv = filled_cache(bits, H_kv, D, n_first=150, n_then=L, window=16)
    assert c.packed_len == 134
    q = mx.random.normal((1, H_kv * G, L, D))
    mask = "causal" if L > 1 else None
    out = turboquant_attention(q, wk, wv, c, D**-0.5, mask)
    close(out, dense_reference(q, c, wk, wv, D**-0.5, mask))
    assert out.dtype == q.dtype and out.shape == q.shape


@pytest.mark.parametrize("quantizer", ["scalar", "tcq"])
@pytest.mark.parametrize("bits,D", [(3, 80), (3.5, 96), (3, 128), (2.5, 128)])
def test_slot_layouts_with_pad_slots_match_dense_attention(quantizer, bits, D):
    """3-bit codes decode through pad slots (decode.SlotLayout): q is zeroed
    there and the value sum drops them; odd head dims leave ragged words."""
    H_kv, G, L = 2, 4, 5
    c, wk, wv = filled_cache(bits, H_kv, D, n_first=140, n_then=L, window=16, quantizer=quantizer)
    assert c.quantizer == quantizer and c.packed_len == 140 - 16
    q = mx.random.normal((1, H_kv * G, L, D))
    full = mx.random.uniform(shape=(L, c.packed_len + wk.shape[2])) > 0.3  # reaches into history
    full[:, -1] = True  # no row fully masked
    for mask in ("causal", full):
        close(turboquant_attention(q, wk, wv, c, D**-0.5, mask), dense_reference(q, c, wk, wv, D**-0.5, mask))


@pytest.mark.parametrize("kind", ["window_bool", "full_bool", "full_additive", "per_head"])
def test_array_masks(kind, monkeypatch):
    monkeypatch.setattr(tqa, "BLOCK", 32)
    H_kv, G, L, D = 2, 4, 5, 64
    c, wk, wv = filled_cache(3.5, H_kv, D, n_first=90, n_then=L, window=8, seed=2)
    P, W = c.packed_len, wk.shape[2]
    q = mx.random.normal((1, H_kv * G, L, D))
    causal = mx.arange(P + W - L, P + W)[:, None] >= mx.arange(P + W)[None]
    mx.random.seed(7)
    drop = mx.random.uniform(shape=causal.shape) < 0.3  # also hide some history
    if kind == "window_bool":
        mask = causal[:, P:]
    elif kind == "full_bool":
        mask = causal & ~drop
    elif kind == "full_additive":
        mask = mx.where(causal & ~drop, 0.0, -1e9)[None, None]
    else:
        per_head = mx.random.uniform(shape=(1, H_kv * G, L, P + W)) < 0.8
        diag = mx.arange(P + W)[None] == mx.arange(P + W - L, P + W)[:, None]
        mask = (causal & per_head) | diag
    out = turboquant_attention(q, wk, wv, c, 0.1, mask)
    close(out, dense_reference(q, c, wk, wv, 0.1, mask))


def test_make_mask_output_is_understood(monkeypatch):
    c, wk, wv = filled_cache(3, 2, 64, n_first=40, n_then=1, window=4)
    mask = c.make_mask(6, return_array=True)
    k, v = mx.random.normal((1, 2, 6, 64)), mx.random.normal((1, 2, 6, 64))
    wk, wv = c.update_and_fetch(k, v)
    assert mask.shape == (6, wk.shape[2])
    q = mx.random.normal((1, 4, 6, 64))
    close(turboquant_attention(q, wk, wv, c, 0.125, mask),
          turboquant_attention(q, wk, wv, c, 0.125, "causal"))


@pytest.mark.parametrize("n_first,n_then,window", [(5, 1, 8), (8, 1, 8), (9, 1, 8), (30, 4, 0)])
def test_window_boundaries(n_first, n_then, window):
    c, wk, wv = filled_cache(4, 2, 64, n_first, n_then, window)
    assert c.packed_len == max(0, n_first - window)
    q = mx.random.normal((1, 4, n_then, 64))
    mask = "causal" if n_then > 1 else None
    close(turboquant_attention(q, wk, wv, c, 0.125, mask),
          dense_reference(q, c, wk, wv, 0.125, mask))


def test_decode_tokens_wait_for_a_batch_before_quantizing():
    """Decode appends one token per step; with the default flush batch
    (window // 2) tokens past the window are quantized together, never one
    launch per step, and the attention stays exact either way."""
    mx.random.seed(5)
    c = TurboQuantKVCache(3.5, window=8, seed=0)
    assert c.flush_batch == 4
    c.update_and_fetch(mx.random.normal((1, 2, 20, 64)), mx.random.normal((1, 2, 20, 64)))
    c.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
    assert c.packed_len == 12  # the prefill chunk flushed everything past the window
    lens = []
    for _ in range(8):
        assert c.make_mask(1) is None
        wk, wv = c.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
        lens.append(c.packed_len)
    assert lens == [12, 12, 12, 16, 16, 16, 16, 20]  # one flush per 4 steps
    assert 8 <= c.window_len < 8 + 4 + 1
    q = mx.random.normal((1, 4, 1, 64))
    close(turboquant_attention(q, wk, wv, c, 0.125, None), dense_reference(q, c, wk, wv, 0.125, None))
    # the mask for a chunk matches the window that chunk will see
    m = c.make_mask(3, return_array=True)
    wk, _ = c.update_and_fetch(mx.random.normal((1, 2, 3, 64)), mx.random.normal((1, 2, 3, 64)))
    assert m.shape[-1] == wk.shape[2]


def test_centring_is_exact_and_helps_on_offset_keys():
    """Centring changes what is quantized, never the attention maths (the test
    above compares against uncentred dense attention).  Here: the gain.
    Measured (keys/values with per-channel offsets 3x the noise, 2.5 bits,
    retrieval-like queries): 1-cos 0.0014 centred vs 0.0111 uncentred (8x)."""
    H_kv, G, D = 2, 4, 64
    mx.random.seed(3)
    bias = 3.0 * mx.random.normal((1, H_kv, 1, D))
    k = mx.random.normal((1, H_kv, 400, D)) + bias
    v = mx.random.normal((1, H_kv, 400, D)) + bias
    # queries that look for particular keys (peaky attention, like retrieval)
    picks = mx.random.randint(0, 400, (H_kv * G,))
    q = (k - bias)[0, mx.arange(H_kv * G) // G, picks][None, :, None, :]
    q = q + 0.5 * mx.random.normal(q.shape)
    kr, vr = mx.repeat(k, G, axis=1), mx.repeat(v, G, axis=1)
    # the decode step below re-appends the last token, so the exact reference has it twice
    kk = mx.concatenate([kr, kr[:, :, -1:]], axis=2)
    vv = mx.concatenate([vr, vr[:, :, -1:]], axis=2)
    ref = mx.softmax((q @ kk.swapaxes(-1, -2)) * D**-0.5, axis=-1) @ vv

    def err(centre):
        c = TurboQuantKVCache(2.5, window=0)
        c.update_and_fetch(k, v)
        if not centre:  # force zero means: plain codec on raw keys
            c.key_mean = mx.zeros((1, H_kv, 1, D))
            c.value_mean = mx.zeros((1, H_kv, 1, D))
        wk, wv = c.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
        out = turboquant_attention(q, wk, wv, c, D**-0.5, None)
        cos = (out * ref).sum(-1) / (mx.linalg.norm(out, axis=-1) * mx.linalg.norm(ref, axis=-1))
        return 1 - cos.mean().item()

    centred, raw = err(True), err(False)
    assert centred < 0.5 * raw, (centred, raw)


def test_sinks_are_refused():
    c, wk, wv = filled_cache(4, 1, 64, 4, 1, 8)
    with pytest.raises(ValueError, match="sinks"):
        turboquant_attention(mx.zeros((1, 1, 1, 64)), wk, wv, c, 1.0, None, sinks=mx.zeros((1,)))


def test_bad_mask_width_is_refused():
    c, wk, wv = filled_cache(4, 1, 64, 20, 2, 8)
    with pytest.raises(ValueError, match="key columns"):
        turboquant_attention(mx.zeros((1, 1, 2, 64)), wk, wv, c, 1.0, mx.ones((2, 3), mx.bool_))


def test_peak_memory_stays_bounded_by_one_block():
    """16k tokens, 8 kv heads, d=128: the dequantized float32 cache would be
    134 MB; attention may only add O(block) on top of the packed cache."""
    H_kv, D, N = 8, 128, 16384
    c = TurboQuantKVCache(3.5, window=128)
    mx.random.seed(0)
    for i in range(0, N, 4096):
        c.update_and_fetch(mx.random.normal((1, H_kv, 4096, D)), mx.random.normal((1, H_kv, 4096, D)))
        mx.eval(c.state)
    wk, wv = c.update_and_fetch(mx.random.normal((1, H_kv, 1, D)), mx.random.normal((1, H_kv, 1, D)))
    q = mx.random.normal((1, 32, 1, D))
    mx.eval(c.state, q)
    dense_bytes = 2 * N * H_kv * D * 4
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(turboquant_attention(q, wk, wv, c, D**-0.5, None))
    extra = mx.get_peak_memory() - base
    assert extra < dense_bytes / 4, (extra, dense_bytes)


def test_batch_and_half_precision_window():
    """B=2 (per-row means and codes) and a float16 model: the window stays
    float16, the maths runs in float32, the output comes back in float16."""
    mx.random.seed(5)
    B, H_kv, G, D = 2, 2, 2, 64
    c = TurboQuantKVCache(3, window=8)
    off = mx.array([[[[0.0]]], [[[4.0]]]])  # different offsets per batch row
    c.update_and_fetch((mx.random.normal((B, H_kv, 50, D)) + off).astype(mx.float16),
                       mx.random.normal((B, H_kv, 50, D)).astype(mx.float16))
    wk, wv = c.update_and_fetch(mx.random.normal((B, H_kv, 3, D)).astype(mx.float16),
                                mx.random.normal((B, H_kv, 3, D)).astype(mx.float16))
    assert wk.dtype == mx.float16 and c.key_mean.shape == (B, H_kv, 1, D)
    assert abs(c.key_mean[1].mean().item() - 4.0) < 0.2
    q = mx.random.normal((B, H_kv * G, 3, D)).astype(mx.float16)
    out = turboquant_attention(q, wk, wv, c, D**-0.5, "causal")
    assert out.dtype == mx.float16
    close(out.astype(mx.float32), dense_reference(q, c, wk, wv, D**-0.5, "causal"), tol=2e-3)


def test_prefill_chunk_memory_is_bounded_by_the_chunk():
    """A 256-token chunk over 8k packed tokens: beyond what the chunk's own
    exact attention takes (its [G*L, window] scores), the packed history adds
    one block plus chunk-sized float32 accumulators ([G*L, D]: q_rot, acc,
    its inverse rotation) -- measured 12.3 MB -- where dequantizing the
    history would take 33.5 MB (and grow with it)."""
    H_kv, G, D, N, L = 4, 4, 128, 8192, 256
    c = TurboQuantKVCache(3.5, window=128)
    mx.random.seed(1)
    c.update_and_fetch(mx.random.normal((1, H_kv, N, D)), mx.random.normal((1, H_kv, N, D)))
    mx.eval(c.state)
    wk, wv = c.update_and_fetch(mx.random.normal((1, H_kv, L, D)), mx.random.normal((1, H_kv, L, D)))
    q = mx.random.normal((1, H_kv * G, L, D))
    mx.eval(c.state, q, wk, wv)
    dense_bytes = 2 * c.packed_len * H_kv * D * 4

    def extra():
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(turboquant_attention(q, wk, wv, c, D**-0.5, "causal"))
        return mx.get_peak_memory() - base

    with_history = extra()
    c.packed_len, packed = 0, c.packed_len  # same call, window only
    window_only = extra()
    c.packed_len = packed
    assert with_history - window_only < dense_bytes / 2, (with_history, window_only, dense_bytes)
