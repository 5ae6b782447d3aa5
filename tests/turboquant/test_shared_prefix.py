"""Rows over one document (shared_prefix): equal to each row attending alone."""

import mlx.core as mx
import pytest
from mlx_lm.models.base import scaled_dot_product_attention as sdpa
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from turboquant.affine import PaddedQuantizedKVCache
from turboquant.attention import turboquant_attention
from turboquant.cache import TurboQuantKVCache
from turboquant.shared_prefix import SharedPrefixCache, shared_prefix_attention

H_KV, G, D = 2, 3, 64
SCALE = D ** -0.5


def _doc(kind: str, n: int, seed: int = 0):
    mx.random.seed(seed)
    k = 2.0 * mx.random.normal((1, H_KV, n, D)) + 1.0
    v = mx.random.normal((1, H_KV, n, D))
    cache = {"turboquant": lambda: TurboQuantKVCache(3.5, window=16, seed=seed),
             "turboquant-scaled": lambda: TurboQuantKVCache(3.5, window=16, seed=seed),
             "fp16": KVCache, "affine": lambda: QuantizedKVCache(group_size=32, bits=4),
             # as made for CUDA: read dequantized (affine.dequantizes)
             "affine-padded": lambda: PaddedQuantizedKVCache(group_size=32, bits=4, pad_multiple=64)}[kind]()
    for a in range(0, n, 40):  # chunked prefill
        cache.update_and_fetch(k[:, :, a:a + 40], v[:, :, a:a + 40])
        if kind == "turboquant-scaled" and a == 0:  # the first chunk's queries, uneven: keys get a scale
            cache.observe_queries(mx.random.normal((1, H_KV * G, 40, D)) * mx.linspace(0.2, 3.0, D))
    if kind.startswith("turboquant"):
        assert (cache.key_scale is not None) == (kind == "turboquant-scaled")
        cache.hold = True
    return cache


def _alone(kind, n_doc, q, k, v):
    """One row, attending over [document; its own tokens] the way a task run
    alone does (a padded affine document: the plain one, same codes)."""
    c = _doc("affine" if kind == "affine-padded" else kind, n_doc)
    wk, wv = c.update_and_fetch(k, v)
    L = q.shape[2]
    if kind.startswith("turboquant"):
        return turboquant_attention(q, wk, wv, c, SCALE, "causal" if L > 1 else None)
    return sdpa(q, wk, wv, c, SCALE, "causal" if L > 1 else None)


@pytest.mark.parametrize("kind", ["turboquant", "turboquant-scaled", "fp16", "affine", "affine-padded"])
def test_rows_sharing_a_document_match_each_row_alone(kind):
    n_doc = 150
    doc = _doc(kind, n_doc)
    if kind.startswith("turboquant"):
        assert doc.packed_len > 0 and doc.window_len > 0  # both document parts in play
    lengths = [5, 2, 4]  # suffixes of different lengths: left-padded to 5
    S = max(lengths)
    mx.random.seed(7)
    B = len(lengths)
    q = mx.random.normal((B, H_KV * G, S, D))
    k = mx.random.normal((B, H_KV, S, D))
    v = mx.random.normal((B, H_KV, S, D))
    rows = SharedPrefixCache(doc, [S - n for n in lengths])
    tk, tv = rows.update_and_fetch(k, v)
    assert rows.offset.tolist() == [n_doc - (S - n) + S for n in lengths]
    out = shared_prefix_attention(q, tk, tv, rows, SCALE)
    # one decode step more: L = 1
    q1, k1, v1 = (mx.random.normal(x.shape[:2] + (1, D)) for x in (q, k, v))
    tk1, tv1 = rows.update_and_fetch(k1, v1)
    out1 = shared_prefix_attention(q1, tk1, tv1, rows, SCALE)
    for b, n in enumerate(lengths):
        sl = slice(S - n, S)
        ref = _alone(kind, n_doc, q[b:b + 1, :, sl], k[b:b + 1, :, sl], v[b:b + 1, :, sl])
        assert mx.allclose(out[b:b + 1, :, sl], ref, atol=2e-4, rtol=2e-4), (kind, b)
        kk = mx.concatenate([k[b:b + 1, :, sl], k1[b:b + 1]], axis=2)
        vv = mx.concatenate([v[b:b + 1, :, sl], v1[b:b + 1]], axis=2)
        qq = mx.concatenate([q[b:b + 1, :, sl], q1[b:b + 1]], axis=2)
        ref1 = _alone(kind, n_doc, qq, kk, vv)[:, :, -1:]
        assert mx.allclose(out1[b:b + 1], ref1, atol=2e-4, rtol=2e-4), (kind, b)
    # the document cache was only read
    assert doc.offset == n_doc


def test_finished_rows_leave_the_batch():
    doc = _doc("fp16", 64)
    rows = SharedPrefixCache(doc, [1, 0, 2])
    mx.random.seed(3)
    k = mx.random.normal((3, H_KV, 3, D))
    rows.update_and_fetch(k, k)
    rows.keep([0, 2])
    assert rows.rows == 2 and rows.keys.shape[0] == 2
    assert rows.offset.tolist() == [64 - 1 + 3, 64 - 2 + 3]
    assert mx.array_equal(rows.keys[1, :, :3], k[2])


def test_document_read_once_for_all_rows(monkeypatch):
    """The packed document is walked once per call, with rows x group as query rows."""
    import turboquant.attention.reference as tqa

    doc = _doc("turboquant", 150)
    seen = []
    real = tqa._packed_part

    def spy(q_rot, cache, mask, g, l, q_plain):
        seen.append(q_rot.shape)
        return real(q_rot, cache, mask, g, l, q_plain)

    monkeypatch.setattr(tqa, "_packed_part", spy)
    rows = SharedPrefixCache(doc, [0, 0, 0, 0])
    mx.random.seed(1)
    x = mx.random.normal((4, H_KV, 1, D))
    tk, tv = rows.update_and_fetch(x, x)
    mx.eval(shared_prefix_attention(mx.random.normal((4, H_KV * G, 1, D)), tk, tv, rows, SCALE))
    assert seen == [(1, H_KV, 4 * G, D)]


def test_kernel_read_of_a_block_mean_document_adds_the_block_bias(monkeypatch):
    """Rows over a document centred on a block mean (as made on a GPU), read
    by a split-K kernel route: the kernel gets the block's key bias, so the
    rows equal the reference read (kernels replaced by MLX ops)."""
    from packed_fixtures import fake_decode, filled_cache

    from turboquant import shared_prefix
    from turboquant.attention import launchers
    from turboquant.attention.route import Route

    doc = filled_cache(3.5, D, H_KV, 700, block_mean=True)
    doc.settle()
    doc.hold = True
    assert doc.mean_blocks and doc.key_mean_pre is not None and doc.packed_len > 64
    mx.random.seed(4)
    q = mx.random.normal((2, H_KV * G, 1, D)) * 2.0
    t = mx.random.normal((2, H_KV, 1, D))

    def rows_out():
        rows = SharedPrefixCache(doc, [0, 0])
        tk, tv = rows.update_and_fetch(t, t)
        return shared_prefix_attention(q, tk, tv, rows, SCALE)

    ref = rows_out()
    monkeypatch.setattr(shared_prefix, "_document_route", lambda q, doc: Route.TC8)
    monkeypatch.setattr(launchers, "decode", fake_decode)
    monkeypatch.setattr(launchers, "key_bias", launchers.key_bias_ops)
    got = rows_out()
    assert mx.allclose(got, ref, atol=1e-4, rtol=1e-4), float(mx.abs(got - ref).max())
