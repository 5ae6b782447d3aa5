"""Task rows over one document on a GPU: the kernel read of the document
(rows x group as query rows: tc8 up to 8, tc beyond) against the reference path."""

from __future__ import annotations

import mlx.core as mx
import pytest

from turboquant.attention import device
from turboquant.cache import TurboQuantKVCache
from turboquant.shared_prefix import SharedPrefixCache, _document_route, shared_prefix_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(device.backend() is None, reason="needs an Apple (Metal) or NVIDIA (CUDA) GPU")]


@pytest.mark.parametrize("rows,L", [(2, 1), (4, 1), (8, 1), (4, 5)])  # x group 4: 8, 16, 32, 80 rows
def test_kernel_rows_match_the_reference_path(monkeypatch, rows, L):
    H, G, D = 8, 4, 128
    mx.random.seed(rows)
    doc = TurboQuantKVCache(3.5, window=128, seed=1)
    k = (2.0 * mx.random.normal((1, H, 4096, D)) + 1.0).astype(mx.bfloat16)
    for a in range(0, 4096, 1024):
        doc.update_and_fetch(k[:, :, a:a + 1024], k[:, :, a:a + 1024] * 0.5)
    doc.settle()
    doc.hold = True
    q = mx.random.normal((rows, H * G, L, D)).astype(mx.bfloat16)
    t = mx.random.normal((rows, H, L, D)).astype(mx.bfloat16)

    def run(mode):
        monkeypatch.setenv("TQ_KERNELS", mode)
        c = SharedPrefixCache(doc, [0] * rows)
        tk, tv = c.update_and_fetch(t, t)
        return shared_prefix_attention(q, tk, tv, c, D ** -0.5).astype(mx.float32)

    monkeypatch.setenv("TQ_KERNELS", "gpu")
    route = _document_route(mx.zeros((1, H, rows * G * L, D)), doc)
    if device.backend() == "cuda":
        assert route.value == ("tc8" if rows * G * L <= 8 else "tc")
    ref, got = run("reference"), run("gpu")
    assert mx.allclose(got, ref, atol=3e-3, rtol=3e-2), float(mx.abs(got - ref).max())


@pytest.mark.parametrize("rows", [2, 8])  # x group 4: tc8, then tc
def test_block_mean_document_rows_match_the_reference_path(monkeypatch, rows):
    """A document centred on a block mean (as made on a GPU): the kernel
    read adds each block's key bias back, as the reference path does."""
    from packed_fixtures import filled_cache

    H, G, D = 2, 4, 128
    doc = filled_cache(3.5, D, H, 4000, block_mean=True)
    doc.settle()
    doc.hold = True
    mx.random.seed(rows)
    q = (2.0 * mx.random.normal((rows, H * G, 1, D))).astype(mx.bfloat16)
    t = mx.random.normal((rows, H, 1, D)).astype(mx.bfloat16)

    def run(mode):
        monkeypatch.setenv("TQ_KERNELS", mode)
        c = SharedPrefixCache(doc, [0] * rows)
        tk, tv = c.update_and_fetch(t, t)
        return shared_prefix_attention(q, tk, tv, c, D ** -0.5).astype(mx.float32)

    ref, got = run("reference"), run("gpu")
    assert mx.allclose(got, ref, atol=3e-3, rtol=3e-2), float(mx.abs(got - ref).max())
