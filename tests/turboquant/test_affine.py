"""Affine KV cache padded to round lengths (CUDA has no odd-length kernel): same attention."""

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import QuantizedKVCache

from turboquant.affine import (
    CUDA_PAD_MULTIPLE, PaddedQuantizedKVCache, cuda_pad_multiple, explain_cuda_error, padded_length,
)
from turboquant.prompt_cache import make_prompt_cache


def test_padded_length():
    assert padded_length(131073, 256) == 131328
    assert padded_length(256, 256) == 256
    assert padded_length(7, 1) == 7
    assert padded_length(300, 256, capacity=400) == 400


def test_cpu_keeps_mlx_cache_and_cuda_error_names_the_limitation():
    assert cuda_pad_multiple() == 1  # this machine: no CUDA device
    model = _model()
    caches = make_prompt_cache(model, kv_bits=4, kv_quant_scheme="affine")
    assert all(type(c) is QuantizedKVCache for c in caches)
    err = explain_cuda_error(RuntimeError("[quantized_matmul] No implementation for problem shape: 1x131073x128x32"))
    assert "MLX's CUDA quantized_matmul" in str(err) and "turboquant" in str(err)
    other = ValueError("x")
    assert explain_cuda_error(other) is other


def _model():
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
                           tie_word_embeddings=False)
    m = llama.Model(args)
    m.set_dtype(mx.float32)
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("prompt_len", [37, 255, 256])  # odd, one short of a granule, round
def test_padded_cache_equals_unpadded_at_every_length(prompt_len):
    """On the default device (CUDA on the GPU machine: odd lengths are exactly
    what has no kernel there) against the unpadded cache on the CPU."""
    model = _model()
    ids = mx.array([[(5 * i + 3) % 95 + 1 for i in range(prompt_len)]])
    plain = [QuantizedKVCache(group_size=32, bits=4) for _ in model.layers]
    padded = [PaddedQuantizedKVCache(group_size=32, bits=4, pad_multiple=CUDA_PAD_MULTIPLE) for _ in model.layers]
    with mx.stream(mx.cpu):
        a = model(ids, cache=plain)
        mx.eval(a)
    b = model(ids, cache=padded)
    assert mx.allclose(a, b, atol=1e-3, rtol=1e-3)
    for t in range(4):  # decode steps over odd and even lengths
        tok = mx.argmax(a[:, -1:], axis=-1)
        with mx.stream(mx.cpu):
            a = model(tok, cache=plain)
            mx.eval(a)
        b = model(tok, cache=padded)
        assert mx.allclose(a, b, atol=1e-3, rtol=1e-3), (prompt_len, t)
        n = prompt_len + t + 1
        assert padded[0].offset == n
        assert padded[0].keys[0].shape[-2] >= padded_length(n, CUDA_PAD_MULTIPLE)  # room for the padding


def test_trimmed_then_regrown_pad_columns_are_never_seen():
    """After a trim the padding columns hold stale tokens: masked, so no effect."""
    model = _model()
    ids = mx.array([[(3 * i + 1) % 95 + 1 for i in range(41)]])
    plain = [QuantizedKVCache(group_size=32, bits=4) for _ in model.layers]
    padded = [PaddedQuantizedKVCache(group_size=32, bits=4, pad_multiple=64) for _ in model.layers]
    model(ids, cache=padded)
    for c in padded:
        c.trim(20)
    model(ids[:, :21], cache=plain)
    tok = mx.array([[9]])
    assert mx.allclose(model(tok, cache=plain), model(tok, cache=padded), atol=1e-4, rtol=1e-4)


def test_attention_over_a_padded_cache_takes_the_dequantized_path(monkeypatch):
    """Every attention call over a padded (CUDA) cache goes to
    dequantized_attention (CUDA's quantized_matmul fails or errs on mlx-lm's
    product), prefill chunks and decode rows; logits as the unpadded cache's."""
    from turboquant import affine, integration

    integration.install()
    calls = []
    real = affine.dequantized_attention

    def counted(queries, *args):
        calls.append(queries.shape[2])
        return real(queries, *args)

    monkeypatch.setattr(integration, "dequantized_attention", counted)
    model = _model()
    ids = mx.array([[(7 * i + 2) % 95 + 1 for i in range(58)]])
    plain = [QuantizedKVCache(group_size=32, bits=4) for _ in model.layers]
    padded = [PaddedQuantizedKVCache(group_size=32, bits=4, pad_multiple=64) for _ in model.layers]
    a, b = model(ids, cache=plain), model(ids, cache=padded)
    assert calls == [58, 58]  # both layers, the whole chunk
    assert mx.allclose(a, b, atol=1e-4, rtol=1e-4)
    for _ in range(3):  # decode rows
        tok = mx.argmax(a[:, -1:], axis=-1)
        a, b = model(tok, cache=plain), model(tok, cache=padded)
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4)
    chunk = mx.array([[5, 6, 7]])  # rows over the cached tokens, ending on 64: no padding, a causal mask
    assert mx.allclose(model(chunk, cache=plain), model(chunk, cache=padded), atol=1e-4, rtol=1e-4)
    assert calls == [58, 58, 1, 1, 1, 1, 1, 1, 3, 3]
