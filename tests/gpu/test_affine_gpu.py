"""The affine KV cache on the GPU at odd cached lengths (MLX's CUDA
quantized_matmul has no kernel for them unpadded, nor for several query
rows over mlx-lm's broadcast keys): the attention against an exact
reference, and a model's prefill + decode steps against the CPU."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import base, llama
from mlx_lm.models.cache import QuantizedKVCache

from turboquant import integration
from turboquant.affine import CUDA_PAD_MULTIPLE, PaddedQuantizedKVCache
from turboquant.attention import device
from turboquant.prompt_cache import make_prompt_cache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(device.backend() is None, reason="needs an Apple (Metal) or NVIDIA (CUDA) GPU")]

D, GROUP, H_Q, H_KV = 128, 64, 8, 2


def _on_grid(shape, seed: int) -> mx.array:
    """Values a 4-bit affine group of 64 holds exactly (multiples of 1/8 from
    0 to 15/8, both ends in every group), so quantizing loses nothing on any
    device and the reference needs no quantization."""
    x = mx.random.randint(0, 16, shape, key=mx.random.key(seed)).astype(mx.float32)
    x[..., 0::GROUP] = 0.0
    x[..., 1::GROUP] = 15.0
    return x / 8


def _reference(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """float32 causal GQA attention on the CPU: row i is token n - rows + i."""
    with mx.stream(mx.cpu):
        rows, n = q.shape[2], k.shape[2]
        k = mx.repeat(k, H_Q // H_KV, axis=1)
        v = mx.repeat(v, H_Q // H_KV, axis=1)
        s = (q * scale) @ k.swapaxes(-1, -2)
        visible = mx.arange(n)[None] <= mx.arange(n - rows, n)[:, None]
        s = mx.where(visible, s, -mx.inf)
        out = mx.softmax(s, axis=-1) @ v
        mx.eval(out)
    return out


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 5e-3), (mx.bfloat16, 3e-2)])
@pytest.mark.parametrize("n,rows", [(37, 37), (131, 1), (257, 1), (257, 5), (300, 44)])
def test_padded_attention_matches_an_exact_reference(n, rows, dtype, tol):
    """A padded cache of n tokens, the last ``rows`` appended as a model
    appends them: one row takes mlx-lm's quantized path, several the
    dequantized one; the padding columns (zeros: they would weigh a lot)
    must get no weight either way."""
    integration.install()
    k, v = _on_grid((1, H_KV, n, D), 1), _on_grid((1, H_KV, n, D), 2)
    q = mx.random.normal((1, H_Q, rows, D), key=mx.random.key(3))
    cache = PaddedQuantizedKVCache(group_size=GROUP, bits=4, pad_multiple=CUDA_PAD_MULTIPLE)
    if n > rows:
        cache.update_and_fetch(k[:, :, :n - rows].astype(dtype), v[:, :, :n - rows].astype(dtype))
    mask = cache.make_mask(rows)  # before the append, as create_attention_mask
    kq, vq = cache.update_and_fetch(k[:, :, n - rows:].astype(dtype), v[:, :, n - rows:].astype(dtype))
    assert kq[0].shape[-2] % CUDA_PAD_MULTIPLE == 0  # padded
    scale = D ** -0.5
    out = base.scaled_dot_product_attention(q.astype(dtype), kq, vq, cache, scale=scale, mask=mask)
    assert mx.allclose(out.astype(mx.float32), _reference(q, k, v, scale), atol=tol, rtol=tol)


@pytest.mark.parametrize("prompt_len", [37, 131, 257])
def test_affine_model_runs_at_odd_lengths(prompt_len):
    """Prefill + decode steps of a model over odd lengths on the GPU, against
    the unpadded cache on the CPU.  The keys are projected on the GPU, whose
    float32 products differ from the CPU's in the last bits; a value near a
    4-bit rounding boundary then takes the neighbouring code, so the logits
    agree to the quantization step (~1e-2), not to float rounding: the
    attention itself is checked exactly above."""
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
        assert mx.all(mx.isfinite(a)).item()
        assert mx.allclose(a.astype(mx.float32), b, atol=5e-2, rtol=5e-2)
        tok = mx.argmax(b[:, -1:], axis=-1)
        a = model(tok, cache=gpu)
        with mx.stream(mx.cpu):
            b = model(tok, cache=cpu)
            mx.eval(b)
