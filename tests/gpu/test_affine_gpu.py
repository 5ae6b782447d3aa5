"""The affine KV cache on the GPU at odd cached lengths (MLX's CUDA
quantized_matmul has no kernel for them unpadded): same logits as the
unpadded cache on the CPU."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import QuantizedKVCache

from turboquant.affine import PaddedQuantizedKVCache
from turboquant.attention import device
from turboquant.prompt_cache import make_prompt_cache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(device.backend() is None, reason="needs an Apple (Metal) or NVIDIA (CUDA) GPU")]


@pytest.mark.parametrize("prompt_len", [37, 131, 257])
def test_affine_decodes_at_odd_lengths(prompt_len):
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
                           tie_word_embeddings=False)
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    gpu = make_prompt_cache(model, kv_bits=4, kv_quant_scheme="affine")
    if device.backend() == "cuda":
        assert all(type(c) is PaddedQuantizedKVCache for c in gpu)
    cpu = [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    ids = mx.array([[(5 * i + 3) % 95 + 1 for i in range(prompt_len)]])
    a = model(ids, cache=gpu)
    with mx.stream(mx.cpu):
        b = model(ids, cache=cpu)
        mx.eval(b)
    for _ in range(6):  # odd and even lengths
        assert mx.allclose(a.astype(mx.float32), b, atol=2e-3, rtol=2e-3)
        tok = mx.argmax(b[:, -1:], axis=-1)
        a = model(tok, cache=gpu)
        with mx.stream(mx.cpu):
            b = model(tok, cache=cpu)
            mx.eval(b)
