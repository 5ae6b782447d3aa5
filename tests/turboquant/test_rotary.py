"""Keys centred on a turned pre-RoPE mean: Rotary reads a model's RoPE angles
exactly; the attention adds q . R(p) mean back exactly (the reference path
and dequantize + SDPA), or its per-block average (every route: what caches
read by GPU kernels are centred on)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE

from turboquant.rotary import Rotary

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
ROPES = {
    "smollm2": lambda: nn.RoPE(64, traditional=False, base=100000.0),
    "traditional": lambda: nn.RoPE(64, traditional=True, base=10000.0),
    "partial-scaled": lambda: nn.RoPE(32, traditional=False, base=10000.0, scale=0.5),
    "llama3": lambda: Llama3RoPE(128, max_position_embeddings=131072, base=500000.0, scaling_config=LLAMA3),
}


@pytest.mark.parametrize("name", ROPES)
@pytest.mark.parametrize("offset", [0, 70000])
def test_rotate_is_the_models_rope(name, offset):
    rope = ROPES[name]()
    D = 128 if name == "llama3" else 64
    x = mx.random.normal((1, 2, 9, D), key=mx.random.key(3))
    r = Rotary.of(rope)
    assert r is not None
    pos = mx.arange(offset, offset + 9)
    want = rope(x, offset=offset)
    # a float32 angle near 70000 rad is only good to ~0.008 rad (one ulp), in MLX's RoPE and here
    atol = 2e-3 if offset == 0 else 3e-2
    assert mx.allclose(r.rotate(x, pos), want, atol=atol)
    assert mx.allclose(r.rotate(r.rotate(x, pos), -pos), x, atol=2e-3)


def test_an_unknown_rope_kind_is_none():
    class Custom(nn.Module):
        def __call__(self, x, offset=0):
            return x

    assert Rotary.of(Custom()) is None


def test_a_rotary_mean_cache_takes_no_kernel_route():
    """Only the reference path and dequantize + SDPA add the per-token
    q . R(p) mean back; a block-mean cache is not a ``rotary_mean`` call."""
    from dataclasses import replace

    from turboquant.attention.route import Call, Route, choose

    call = Call(batch=1, q_heads=4, kv_heads=2, length=1, head_dim=64, window_key_dim=64, value_dim=64,
                window=8, packed=512, capacity=512, key_bits=4, value_bits=3, itemsize=2, codec_dim=64,
                scalar_codes=True, hadamard=True, packed_mask=False, window_mask=False, sinks=False, on_gpu=True)
    assert choose(call, "cuda", "auto") is Route.FUSED_STEP
    assert choose(replace(call, rotary_mean=True), "cuda", "auto") is Route.DEQUANT_SDPA
    assert choose(replace(call, rotary_mean=True, packed=1 << 24, capacity=1 << 24), "cuda", "auto") is Route.REFERENCE
    assert choose(replace(call, rotary_mean=True, on_gpu=False), None, "auto") is Route.REFERENCE

    from packed_fixtures import filled_cache

    from turboquant.attention.route import describe

    c = filled_cache(3.5, 64, 2, 300, block_mean=True)
    k = mx.random.normal((1, 2, 1, 64))
    wk, wv = c.update_and_fetch(k, k)
    q = mx.random.normal((1, 8, 1, 64))
    assert c.key_mean_pre is not None
    assert not describe(q, wk, wv, c, None, None, None, True).rotary_mean
    c.mean_blocks = False
    assert describe(q, wk, wv, c, None, None, None, True).rotary_mean


@pytest.mark.parametrize("blocks", [False, True])
def test_reference_attention_over_a_rotary_centred_cache_is_attention_over_its_reconstruction(blocks):
    """Exactness of the add-back: the packed part equals dense attention over
    dequantized residual + R(p) mean_pre, or its average over each block of
    32 packed tokens (values + their mean), sinks exact."""
    from turboquant.rotary import MEAN_BLOCK
    from turboquant.attention.reference import reference_attention
    from turboquant.cache import TurboQuantKVCache

    rope = nn.RoPE(64, base=100000.0)
    T, pos = 300, mx.arange(300)
    k_pre = 0.3 * mx.random.normal((1, 2, T, 64), key=mx.random.key(1)) + 3 * mx.random.normal((1, 2, 1, 64), key=mx.random.key(2))
    k = rope(k_pre)
    v = mx.random.normal((1, 2, T, 64), key=mx.random.key(3))
    c = TurboQuantKVCache(kv_bits=3.5, window=0)
    c.rotary, c.mean_blocks = Rotary.of(rope), blocks
    c.update_and_fetch(k, v)
    c.settle()
    assert c.key_mean_pre is not None and c.packed_len == T - c.sink_len
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(4))
    out = reference_attention(q, c.window_keys, c.window_values, c, 0.125)

    P, s = c.packed_len, c.sink_len
    kp = c.key_codec.dequantize(c.keys_packed[:, :, :P], c.keys_norms[:, :, :P]) + c.key_mean
    turned = c.rotary.rotate(mx.broadcast_to(c.key_mean_pre, kp.shape), mx.arange(s, s + P))
    if blocks:  # each token gets its whole block's average, the partial last block too
        nb = -(-P // MEAN_BLOCK)
        assert P % MEAN_BLOCK  # (exercises the partial block)
        whole = c.rotary.rotate(mx.broadcast_to(c.key_mean_pre, (1, 2, nb * MEAN_BLOCK, 64)),
                                mx.arange(s, s + nb * MEAN_BLOCK))
        means = whole.reshape(1, 2, nb, MEAN_BLOCK, 64).mean(axis=3)
        turned = mx.repeat(means, MEAN_BLOCK, axis=2)[:, :, :P]
    kp = kp + turned
    vp = c.value_codec.dequantize(c.values_packed[:, :, :P], c.values_norms[:, :, :P]) + c.value_mean
    keys = mx.concatenate([c.window_keys.astype(mx.float32), kp], axis=2)
    values = mx.concatenate([c.window_values.astype(mx.float32), vp], axis=2)
    scores = (q.reshape(1, 2, 2, 64) @ keys.swapaxes(-1, -2)) * 0.125
    dense = (mx.softmax(scores, axis=-1) @ values).reshape(1, 4, 1, 64)
    assert mx.allclose(out, dense, atol=1e-4)
    # and it is attention over the original keys up to the codec's error
    exact = (mx.softmax((q.reshape(1, 2, 2, 64) @ k.swapaxes(-1, -2)) * 0.125, axis=-1) @ v).reshape(1, 4, 1, 64)
    assert mx.abs(out - exact).max().item() < 0.2


def test_dequant_sdpa_over_a_rotary_centred_cache_matches_the_reference_path(monkeypatch):
    """The dequantize + SDPA route (GPU prefill) adds the turned mean to the
    history it dequantizes; the GPU dequantize kernel is stood in for by the
    codec's own rotated-domain dequantize (what it computes)."""
    from turboquant.attention import compose, launchers
    from turboquant.attention.reference import reference_attention
    from turboquant.cache import TurboQuantKVCache

    codecs = {}

    def dequantize(packed, norms, centroids, n, bits, dim, dtype=mx.float16, mean_rot=None):
        codec = codecs[packed.shape[-1]]
        out = codec.dequantize_rotated(packed[:, :, :n], norms[:, :, :n])
        if mean_rot is not None:
            out = out + mean_rot[:, :, None, :]
        return out.astype(dtype)

    monkeypatch.setattr(launchers, "dequantize", dequantize)
    rope = nn.RoPE(64, base=100000.0)
    k = rope(0.3 * mx.random.normal((1, 2, 300, 64), key=mx.random.key(1)) + 3 * mx.random.normal((1, 2, 1, 64), key=mx.random.key(2)))
    v = mx.random.normal((1, 2, 300, 64), key=mx.random.key(3))
    c = TurboQuantKVCache(kv_bits=3.5, window=16)
    c.rotary = Rotary.of(rope)
    c.update_and_fetch(k, v)
    c.settle()
    codecs[c.keys_packed.shape[-1]], codecs[c.values_packed.shape[-1]] = c.key_codec, c.value_codec
    assert c.keys_packed.shape[-1] != c.values_packed.shape[-1]  # 4-bit keys, 3-bit values: told apart by width
    q = mx.random.normal((1, 4, 3, 64), key=mx.random.key(4))
    want = reference_attention(q, c.window_keys, c.window_values, c, 0.125, "causal")
    got = compose.dequant_sdpa_attention(q.astype(mx.float32), c.window_keys, c.window_values, c, 0.125, "causal")
    assert mx.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("name", ROPES)
def test_block_rows_are_the_average_of_the_turned_mean_over_each_block(name):
    """The Dirichlet form of a block's average equals averaging the turned
    mean over its 32 positions; block_bias (the kernels' term) is q . that,
    block-major; a partial last block uses the whole block's average."""
    from turboquant.rotary import MEAN_BLOCK

    rope = ROPES[name]()
    D = 128 if name == "llama3" else 64
    r = Rotary.of(rope)
    mean = mx.random.normal((1, 2, 1, D), key=mx.random.key(6))
    q = mx.random.normal((1, 2, 3, D), key=mx.random.key(5))
    for origin, blocks in ((4, 3), (0, 5), (6000, 2)):
        stop = origin + blocks * MEAN_BLOCK
        exact = r.turned(mean, origin, stop).reshape(1, 2, blocks, MEAN_BLOCK, D).mean(axis=3)
        rows = r.turned(mean, origin, stop, origin)
        assert mx.allclose(rows[:, :, ::MEAN_BLOCK], exact, atol=2e-3)
        assert mx.array_equal(rows, mx.repeat(rows[:, :, ::MEAN_BLOCK], MEAN_BLOCK, axis=2))
        bias = r.block_bias(q, mean, origin, blocks)
        assert bias.shape == (1, 2, blocks, 3)
        assert mx.allclose(bias, (q @ exact.swapaxes(-1, -2)).swapaxes(-1, -2), atol=2e-3)
        assert mx.allclose(r.score_bias(q, mean, origin + 5, stop - 3, origin),
                           q @ rows[:, :, 5:-3].swapaxes(-1, -2), atol=1e-3)


@pytest.mark.parametrize("name", ROPES)
def test_score_bias_is_q_dot_the_turned_mean(name):
    """The angle-table form equals turning the mean and taking dot products,
    also past the table's first size (it grows) and for a partial RoPE."""
    rope = ROPES[name]()
    D = 128 if name == "llama3" else 64
    r = Rotary.of(rope)
    q = mx.random.normal((1, 2, 3, D), key=mx.random.key(5))
    mean = mx.random.normal((1, 2, 1, D), key=mx.random.key(6))
    for start, stop in ((0, 40), (5000, 5100), (9000, 9003)):
        pos = mx.arange(start, stop)
        want = q @ r.rotate(mx.broadcast_to(mean, (1, 2, stop - start, D)), pos).swapaxes(-1, -2)
        assert mx.allclose(r.score_bias(q, mean, start, stop), want, atol=1e-3)
    assert r.table(1).shape[0] >= 9003


def test_block_mean_where_kernels_read_the_cache_the_exact_mean_elsewhere():
    from turboquant.attention.route import block_mean_wanted

    assert not block_mean_wanted(None, "auto", False)  # CPU
    assert not block_mean_wanted("cuda", "auto", False)  # CUDA build, CPU default device
    assert not block_mean_wanted("cuda", "reference", True)  # kernels off
    assert block_mean_wanted("cuda", "auto", True)
    assert block_mean_wanted("metal", "auto", True)


def test_a_block_mean_cache_saves_and_loads_as_one():
    from packed_fixtures import filled_cache

    from turboquant.attention.reference import reference_attention
    from turboquant.cache import TurboQuantKVCache

    c = filled_cache(3.5, 64, 2, 300, block_mean=True)
    k = mx.random.normal((1, 2, 1, 64))
    c.update_and_fetch(k, k)
    back = TurboQuantKVCache.from_state(c.state[:len(TurboQuantKVCache._ARRAYS)], c.meta_state)
    assert back.mean_blocks and back.rotary is c.rotary and back.mean_origin == c.sink_len
    q = mx.random.normal((1, 8, 1, 64))
    assert mx.array_equal(reference_attention(q, back.window_keys, back.window_values, back, 0.125),
                          reference_attention(q, c.window_keys, c.window_values, c, 0.125))
    c.mean_blocks = False
    assert not TurboQuantKVCache.from_state(c.state[:len(TurboQuantKVCache._ARRAYS)], c.meta_state).mean_blocks


def test_make_prompt_cache_turns_the_mean_exactly_on_the_cpu_per_block_on_gpus(monkeypatch):
    """Every layer gets its RoPE's angles, one shared instance (one angle
    table); the mean is turned per token on the CPU, per block of packed
    tokens where kernels read the cache (a GPU)."""
    from mlx_lm.models import llama

    import turboquant.prompt_cache as pc

    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=3, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
                           rope_theta=10000.0)
    model = llama.Model(args)
    caches = pc.make_prompt_cache(model, kv_bits=3.5, window=4)
    assert all(c.rotary is caches[0].rotary for c in caches) and caches[0].rotary is not None
    assert mx.allclose(caches[0].rotary.theta, Rotary.of(model.layers[0].self_attn.rope).theta)
    assert not any(c.mean_blocks for c in caches)
    monkeypatch.setattr(pc, "on_gpu", lambda: True)
    monkeypatch.setattr(pc, "backend", lambda: "cuda")
    monkeypatch.setattr(pc, "mode", lambda: "auto")
    gpu = pc.make_prompt_cache(model, kv_bits=3.5, window=4)
    assert all(c.rotary is caches[0].rotary and c.mean_blocks for c in gpu)


def test_a_rotary_cache_saved_and_loaded_attends_the_same(tmp_path):
    """The mean and the angles travel in the saved state; the loaded cache
    shares the process's angle table and gives the same attention."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from turboquant.attention.reference import reference_attention
    from turboquant.cache import TurboQuantKVCache
    from turboquant.integration import install

    install()  # registers the class with mlx-lm's loader
    rope = nn.RoPE(64, base=100000.0)
    k = rope(0.3 * mx.random.normal((1, 2, 200, 64), key=mx.random.key(1)) + 2 * mx.random.normal((1, 2, 1, 64), key=mx.random.key(2)))
    v = mx.random.normal((1, 2, 200, 64), key=mx.random.key(3))
    c = TurboQuantKVCache(kv_bits=3.5, window=8)
    c.rotary = Rotary.of(rope).canonical()
    c.update_and_fetch(k, v)
    c.settle()
    assert c.key_mean_pre is not None
    save_prompt_cache(str(tmp_path / "c.safetensors"), [c])
    (d,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert d.rotary is c.rotary and mx.array_equal(d.key_mean_pre, c.key_mean_pre)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(4))
    a = reference_attention(q, c.window_keys, c.window_values, c, 0.125)
    b = reference_attention(q, d.window_keys, d.window_values, d, 0.125)
    assert mx.array_equal(a, b)


def test_checkpoint_restore_brings_the_turned_mean_back():
    from turboquant.cache import TurboQuantKVCache

    rope = nn.RoPE(64, base=10000.0)
    c = TurboQuantKVCache(kv_bits=3.5, window=4)
    c.rotary = Rotary.of(rope)
    mark = c.checkpoint()
    c.update_and_fetch(*(mx.random.normal((1, 1, 20, 64), key=mx.random.key(i)) for i in (1, 2)))
    c.settle()
    assert c.key_mean_pre is not None
    c.restore(mark)
    assert c.key_mean_pre is None and c.key_mean is None


@pytest.mark.parametrize("quantizer", ["scalar", "tcq"])
def test_a_prefill_chunk_over_a_rotary_cache_adds_the_turned_mean_to_the_keys(quantizer):
    """Many rows (a prefill chunk) take the turned mean added to the decoded
    keys, not a per-row bias; the attention is the same: dense attention over
    the reconstruction, causal mask over the chunk."""
    from turboquant.attention.reference import reference_attention
    from turboquant.cache import TurboQuantKVCache

    rope = nn.RoPE(64, base=100000.0)
    T, L = 400, 48
    k = rope(0.3 * mx.random.normal((1, 2, T, 64), key=mx.random.key(1)) + 3 * mx.random.normal((1, 2, 1, 64), key=mx.random.key(2)))
    v = mx.random.normal((1, 2, T, 64), key=mx.random.key(3))
    c = TurboQuantKVCache(kv_bits=3.5, window=16, quantizer=quantizer)
    c.rotary = Rotary.of(rope)
    c.update_and_fetch(k[:, :, : T - L], v[:, :, : T - L])
    c.settle()
    wk, wv = c.update_and_fetch(k[:, :, T - L:], v[:, :, T - L:])
    P, s = c.packed_len, c.sink_len
    q = mx.random.normal((1, 4, L, 64), key=mx.random.key(4))
    assert 2 * L > c.key_codec.dim  # rows per kv head beyond the slots: the added-keys form
    out = reference_attention(q, wk, wv, c, 0.125, "causal")

    kp = c.key_codec.dequantize(c.keys_packed[:, :, :P], c.keys_norms[:, :, :P]) + c.key_mean
    kp = kp + c.rotary.rotate(mx.broadcast_to(c.key_mean_pre, kp.shape), mx.arange(s, s + P))
    vp = c.value_codec.dequantize(c.values_packed[:, :, :P], c.values_norms[:, :, :P]) + c.value_mean
    keys = mx.concatenate([wk[:, :, :s].astype(mx.float32), kp, wk[:, :, s:].astype(mx.float32)], axis=2)
    values = mx.concatenate([wv[:, :, :s].astype(mx.float32), vp, wv[:, :, s:].astype(mx.float32)], axis=2)
    n = keys.shape[2]
    scores = (q.reshape(1, 2, 2, L, 64) @ keys[:, :, None].swapaxes(-1, -2)) * 0.125
    allowed = mx.arange(n)[None, :] <= (n - L + mx.arange(L))[:, None]
    scores = mx.where(allowed, scores, -mx.inf)
    dense = (mx.softmax(scores, axis=-1) @ values[:, :, None]).reshape(1, 4, L, 64)
    assert mx.allclose(out, dense, atol=1e-4)


def test_turned_from_the_table_is_rotate():
    for rope, D in ((nn.RoPE(64, base=1e5), 64), (nn.RoPE(64, traditional=True), 64), (nn.RoPE(32, scale=0.5), 64)):
        r = Rotary.of(rope)
        m = mx.random.normal((1, 2, 1, D), key=mx.random.key(7))
        want = r.rotate(mx.broadcast_to(m, (1, 2, 200, D)), mx.arange(100, 300))
        assert mx.allclose(r.turned(m, 100, 300), want, atol=1e-5)


def test_a_gpu_cache_turns_its_top_pairs_and_centres_the_rest_on_a_constant():
    """``mean_pairs``: the pre-RoPE mean is kept on the layer's top pairs
    only (by the energy a block mean removes), the rest of the offset goes
    to the constant mean; attention is still exact over the reconstruction
    (the reference adds both back) and ``turned_pairs`` names the pairs the
    fused step's compact table covers."""
    import numpy as np
    from packed_fixtures import dense_reference, filled_cache

    from turboquant.attention.reference import reference_attention
    from turboquant.rotary import MEAN_PAIRS

    c = filled_cache(3.5, 128, 2, 600, block_mean=True)
    k = mx.random.normal((1, 2, 1, 128))
    wk, wv = c.update_and_fetch(k, k)
    m = np.asarray(c.key_mean_pre).reshape(2, 128)
    live = np.flatnonzero((m[:, :64] ** 2 + m[:, 64:] ** 2).sum(0) > 0)
    assert 0 < len(live) <= MEAN_PAIRS and float(mx.abs(c.key_mean).max()) > 0.1
    pairs = c.turned_pairs
    assert len(pairs) == MEAN_PAIRS and set(live) <= set(pairs) and list(pairs) == sorted(pairs)
    table = c.rotary.block_table(c.sink_len, 10, pairs)
    full = c.rotary.block_table(c.sink_len, 10)
    cols = list(pairs) + [64 + j for j in pairs]
    assert mx.allclose(table[:10], full[:10, mx.array(cols)], atol=1e-6)
    q = mx.random.normal((1, 8, 1, 128))
    out = reference_attention(q, wk, wv, c, 0.088)
    assert mx.allclose(out, dense_reference(q, c, wk, wv, 0.088, None), atol=1e-4)
    c.mean_pairs = 0  # all pairs turned: more than the compact table holds
    c2 = filled_cache(3.5, 128, 2, 600, block_mean=True)
    c2.mean_pairs = 0
    c2.update_and_fetch(k, k)
    assert c2.turned_pairs is None
