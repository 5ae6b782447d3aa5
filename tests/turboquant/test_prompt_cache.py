"""make_prompt_cache: which layers get which cache, options, errors."""

import importlib.util
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from tiny_models import prompt_tokens, tiny_llama
from turboquant import TurboQuantKVCache, make_prompt_cache


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=0, num_hidden_layers=3)


def test_turboquant_converts_every_plain_layer_with_per_layer_seeds(llama):
    caches = make_prompt_cache(llama, kv_bits=2.5, seed=10, window=32)
    assert [type(c) for c in caches] == [TurboQuantKVCache] * 3
    assert [c.seed for c in caches] == [10, 11, 12]
    assert all((c.key_bits, c.value_bits, c.window) == (3, 2, 32) for c in caches)


def test_separate_key_and_value_widths(llama):
    c = make_prompt_cache(llama, kv_bits=None, key_bits=4, value_bits=2)[0]
    assert (c.key_bits, c.value_bits) == (4, 2)


def test_baselines_through_the_same_call(llama):
    fp16 = make_prompt_cache(llama, kv_quant_scheme="fp16")
    assert [type(c) for c in fp16] == [KVCache] * 3
    affine = make_prompt_cache(llama, kv_bits=4, kv_quant_scheme="affine", affine_group_size=32)
    assert [type(c) for c in affine] == [QuantizedKVCache] * 3
    assert (affine[0].bits, affine[0].group_size) == (4, 32)
    assert make_prompt_cache(llama, kv_quant_scheme="affine")[0].bits == 4  # the README's call: affine's own default


def test_sliding_window_layers_are_left_alone_and_generation_works():
    model = tiny_llama(
        seed=1, num_hidden_layers=4, sliding_window=32,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    caches = make_prompt_cache(model, kv_bits=3)
    assert [type(c) for c in caches] == [RotatingKVCache, TurboQuantKVCache] * 2
    assert [c.seed for c in caches[1::2]] == [1, 3]  # seed = base + layer index
    for c in caches[1::2]:
        c.window = 8  # make the full-attention layers use packed history
    toks = [int(t) for t, _ in generate_step(prompt_tokens(120), model, prompt_cache=caches,
                                             max_tokens=5, prefill_step_size=50)]
    assert len(toks) == 5 and caches[1].packed_len > 100 and caches[0].offset == caches[1].offset


class _Layers(nn.Module):
    """A model without make_cache: mlx-lm's default cache path applies."""

    def __init__(self, n):
        super().__init__()
        self.layers = [nn.Linear(2, 2) for _ in range(n)]


def test_default_cache_path_and_max_kv_size():
    assert [type(c) for c in make_prompt_cache(_Layers(2), kv_bits=4)] == [TurboQuantKVCache] * 2
    # max_kv_size: mlx-lm gives sliding RotatingKVCaches, which stay as they are
    caches = make_prompt_cache(_Layers(2), kv_bits=4, max_kv_size=64)
    assert [type(c) for c in caches] == [RotatingKVCache] * 2
    assert caches[0].max_size == 64


def test_unknown_scheme_and_widths_fail_clearly(llama):
    with pytest.raises(ValueError, match="kv_quant_scheme"):
        make_prompt_cache(llama, kv_quant_scheme="int3")
    with pytest.raises(ValueError, match="kv_bits=5"):
        make_prompt_cache(llama, kv_bits=5)
    with pytest.raises(ValueError, match="affine kv_bits=3.5"):
        make_prompt_cache(llama, kv_bits=3.5, kv_quant_scheme="affine")


_DIRECT = '''
import mlx.core as mx
import mlx.nn as nn

class Attention(nn.Module):
    def __call__(self, q, k, v, cache):
        k, v = cache.update_and_fetch(k, v)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0)

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [Attention()]
'''


def test_models_that_bypass_the_hook_are_refused(tmp_path, monkeypatch):
    path = tmp_path / "direct_attention.py"
    path.write_text(_DIRECT)
    name = "mlx_lm.models._tq_test_direct"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    with pytest.raises(ValueError, match="_tq_test_direct"):
        make_prompt_cache(module.Model(), kv_bits=4)
    # the baselines do not depend on the hook
    assert type(make_prompt_cache(module.Model(), kv_quant_scheme="fp16")[0]) is KVCache
