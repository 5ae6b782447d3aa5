"""A document cache read on CUDA lands in GPU memory in bulk and decodes
exactly as the cache it was saved from."""

from __future__ import annotations

import mlx.core as mx
import pytest

from pipeline.inference import gpu_upload, kv_file
from tiny_models import prompt_tokens, tiny_llama
from turboquant import make_prompt_cache
from turboquant.attention import device

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(device.backend() != "cuda", reason="needs an NVIDIA GPU (CUDA managed memory)")]


@pytest.mark.parametrize("staged", [True, False], ids=["staged-upload", "load-then-prefetch"])
def test_a_read_cache_is_moved_to_the_gpu_and_decodes_like_the_saved_one(tmp_path, monkeypatch, staged):
    if not staged:
        monkeypatch.setattr(gpu_upload, "available", lambda: False)
    model = tiny_llama(seed=0, num_hidden_layers=2)
    caches = make_prompt_cache(model, kv_quant_scheme="turboquant", kv_bits=3.5, window=16)
    toks = prompt_tokens(600)
    for s in range(0, 600, 128):
        model(toks[None, s : s + 128], cache=caches)
        mx.eval([c.state for c in caches])
    path = tmp_path / "doc.safetensors"
    kv_file.write(path, caches, toks.tolist(), key={"doc": "d"}, info={})
    got = kv_file.read(path, key={"doc": "d"})
    assert got.on_gpu and gpu_upload.available() == staged, "the driver refused (see the log)"
    if staged:
        flipped = bytearray(path.read_bytes())
        flipped[len(flipped) // 2] ^= 1
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(bytes(flipped))
        with pytest.raises(kv_file.CacheFileError, match="checksum mismatch"):
            kv_file.read(bad, key={"doc": "d"})
    nxt = mx.array([[7]])
    a = model(nxt, cache=caches)[0, -1]
    b = model(nxt, cache=got.caches)[0, -1]
    # the split-K kernels' summation order varies from launch to launch
    assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


def test_prefetch_of_a_big_array_keeps_its_bytes():
    a = mx.random.randint(0, 1 << 30, (1 << 22,), dtype=mx.uint32, key=mx.random.key(1))
    with mx.stream(mx.cpu):
        b = a + 0  # written by the host
    mx.eval(b)
    assert gpu_upload.to_gpu([b])
    assert mx.array_equal(a, b).item()
