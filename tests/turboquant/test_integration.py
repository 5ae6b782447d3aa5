"""End to end: mlx-lm and mlx-vlm models run on TurboQuantKVCache through
the attention hook alone (no model file edited)."""

import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

import turboquant.integration as integration
from tiny_models import prompt_tokens, tiny_llama
from turboquant import TurboQuantKVCache, make_prompt_cache
from turboquant.policy import SINK_TOKENS
from turboquant.widths import ALLOWED_KV_BITS

WINDOW = 16  # small, so most of each prompt is served from packed codes


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=0)


@pytest.fixture
def dispatch_count(monkeypatch):
    """Counts calls that the hook routes to turboquant_attention."""
    calls = []
    real = integration.turboquant_attention

    def counting(*args, **kwargs):
        calls.append(args[3].packed_len)
        return real(*args, **kwargs)

    monkeypatch.setattr(integration, "turboquant_attention", counting)
    return calls


def greedy(model, prompt, cache, n=12):
    return [int(t) for t, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=n, prefill_step_size=64)]


def last_logits(model, prompt, cache, chunk=64):
    for a in range(0, prompt.size - 1, chunk):
        model(prompt[None, a : min(a + chunk, prompt.size - 1)], cache=cache)
    return model(prompt[None, -1:], cache=cache)[0, -1]


def test_install_is_idempotent_and_rebinds_imported_model_modules(monkeypatch, dispatch_count):
    import types

    import mlx_lm.models.base as lm_base
    import mlx_lm.models.llama as llama_mod
    import mlx_vlm.models.base as vlm_base
    import mlx_vlm.models.qwen2_vl.language as qwen2_vl_lang

    integration.install()
    first = lm_base.scaled_dot_product_attention
    integration.install()
    assert lm_base.scaled_dot_product_attention is first  # not wrapped twice
    assert first._turboquant and not getattr(first.__wrapped__, "_turboquant", False)
    assert vlm_base.scaled_dot_product_attention._turboquant
    assert integration.is_installed()

    # a model module that bound the original by name gets the wrapper
    fake = types.ModuleType("mlx_vlm.models._tq_fake_model")
    fake.scaled_dot_product_attention = vlm_base.scaled_dot_product_attention.__wrapped__
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    integration.install()
    assert fake.scaled_dot_product_attention is vlm_base.scaled_dot_product_attention

    # and the real model modules route a TurboQuant cache to our attention
    # (checked by behaviour: other code may have wrapped them again since)
    c = TurboQuantKVCache(4, window=0)
    k = mx.random.normal((1, 2, 20, 64))
    c.update_and_fetch(k, k)
    wk, wv = c.update_and_fetch(k[:, :, :1], k[:, :, :1])
    q = mx.random.normal((1, 4, 1, 64))
    for module in (llama_mod, qwen2_vl_lang):
        module.scaled_dot_product_attention(q, wk, wv, c, scale=0.125, mask=None)
    assert dispatch_count == [20 - SINK_TOKENS] * 2  # packed: all but the sinks


def test_other_caches_go_to_the_original_unchanged():
    import mlx_lm.models.base as lm_base

    integration.install()
    wrapper, original = lm_base.scaled_dot_product_attention, lm_base.scaled_dot_product_attention.__wrapped__
    mx.random.seed(0)
    q, k, v = (mx.random.normal((1, 4, 8, 64)) for _ in range(3))
    kvc = KVCache()
    assert mx.array_equal(wrapper(q, k, v, kvc, 0.125, "causal"), original(q, k, v, kvc, scale=0.125, mask="causal"))
    qc = QuantizedKVCache(group_size=64, bits=8)
    qk, qv = qc.update_and_fetch(k, v)
    # (mlx-lm's quantized attention scales its queries in place: pass copies)
    a = wrapper(mx.array(q), qk, qv, qc, 0.125, None)
    assert mx.array_equal(a, original(mx.array(q), qk, qv, qc, scale=0.125, mask=None))


@pytest.mark.parametrize("kv_bits", ALLOWED_KV_BITS)
def test_mlx_lm_generation_runs_at_every_width(llama, kv_bits, dispatch_count):
    cache = make_prompt_cache(llama, kv_bits=kv_bits, window=WINDOW)
    tokens = greedy(llama, prompt_tokens(200), cache)
    assert len(tokens) == 12 and all(0 <= t < 256 for t in tokens)
    # generate_step computes one token ahead: 200 prompt + 11 or 12 fed back
    assert cache[0].packed_len > 150 and cache[0].offset >= 200 + 11
    # every layer's attention went through the packed path, prefill and decode
    assert len(dispatch_count) >= 2 * (200 // 64 + 11) and max(dispatch_count) > 150


def test_exact_while_everything_fits_in_the_window(llama):
    p = prompt_tokens(100)
    ref = last_logits(llama, p, make_prompt_cache(llama, kv_quant_scheme="fp16"))
    out = last_logits(llama, p, make_prompt_cache(llama, kv_bits=2, window=128))
    assert mx.abs(out - ref).max().item() < 1e-4


def test_4bit_greedy_output_matches_fp16_on_fixture_prompts(llama):
    """Measured on this seeded tiny llama (300-token prompts, window 16, 24
    greedy tokens): 4 bits agrees with the fp16 cache for the first 1 / 5 / 6
    tokens of prompt seeds 0 / 1 / 2 (affine 4-bit: comparable logit error,
    0.45 vs our 0.38 max |dlogit| on seed 0).  A random-weight model has
    near-flat logits (top-2 margin ~0.6, std ~1), so this is a weak model for
    agreement; what we assert is the first token and close logits."""
    for seed in range(3):
        p = prompt_tokens(300, seed=seed)
        ref = greedy(llama, p, make_prompt_cache(llama, kv_quant_scheme="fp16"), n=4)
        out = greedy(llama, p, make_prompt_cache(llama, kv_bits=4, window=WINDOW), n=4)
        assert out[0] == ref[0], (seed, out, ref)
        ref_l = last_logits(llama, p, make_prompt_cache(llama, kv_quant_scheme="fp16"))
        out_l = last_logits(llama, p, make_prompt_cache(llama, kv_bits=4, window=WINDOW))
        assert mx.abs(out_l - ref_l).max().item() < 0.6 * ref_l.std().item()


def test_saved_cache_continues_with_identical_logits(llama, tmp_path):
    p = prompt_tokens(150)
    cache = make_prompt_cache(llama, kv_bits=3.5, window=WINDOW)
    last_logits(llama, p, cache)
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    nxt = mx.array([[7, 8, 9]])
    a = llama(nxt, cache=cache)
    b = llama(nxt, cache=loaded)
    assert mx.array_equal(a, b)
    assert loaded[0].packed_len == cache[0].packed_len > 0
    # every layer calibrated its key scale on the prompt's queries (the hook saw them)
    assert all(c.key_scale is not None and mx.array_equal(c.key_scale, d.key_scale) for c, d in zip(cache, loaded))


# ---------------------------------------------------------------- mlx-vlm
@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    import mlx_vlm

    from pipeline.models.builtin_vlm import build_tiny_vlm

    path = tmp_path_factory.mktemp("tiny_vlm")
    build_tiny_vlm(path)
    model, _ = mlx_vlm.load(str(path))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def vlm_ids(n=200, seed=1):
    """Prompt ids inside the tiny VLM's vocabulary (859 tokens; an id past
    the embedding table crashes MLX's CPU gather instead of raising)."""
    return (prompt_tokens(n, seed=seed, vocab=700) + 100)[None]


def vlm_greedy(model, ids, cache, n=6):
    """Greedy tokens and the first step's log-probs from mlx-vlm's own
    ``generate_step`` (chunked prefill of 64, then decode)."""
    from mlx_vlm.generate.ar import generate_step as vlm_step

    # Qwen2-VL keeps M-RoPE positions from a previous generation unless reset
    model.language_model._position_ids = model.language_model._rope_deltas = None
    steps = list(vlm_step(ids, model, None, None, prompt_cache=cache, max_tokens=n,
                          prefill_step_size=64, temperature=0.0))
    return [int(t) for t, _ in steps], steps[0][1]


@pytest.mark.parametrize("kv_bits", ALLOWED_KV_BITS)
def test_mlx_vlm_qwen2_vl_generation_runs_at_every_width(tiny_vlm, kv_bits, dispatch_count):
    ids = vlm_ids()
    cache = make_prompt_cache(tiny_vlm, kv_bits=kv_bits, window=WINDOW)
    assert all(type(c).__name__ == "TurboQuantKVCache" for c in cache)
    tokens, _ = vlm_greedy(tiny_vlm, ids, cache)
    assert len(tokens) == 6
    assert cache[0].packed_len > 150 and max(dispatch_count) > 150


def test_mlx_vlm_4bit_greedy_and_logprobs_track_fp16(tiny_vlm):
    """Tiny seeded Qwen2-VL, 300-token prompts, window 16, 12 greedy tokens.
    Measured: 4-bit agrees with the fp16 cache on 12/12 tokens for prompt
    seeds 0 and 2 and on 0/12 for seed 1 (so does mlx's affine 4-bit: the
    random model's top-2 margin there is tiny).  First-step max |dlogprob|:
    0.29 / 0.14 / 0.17 for TurboQuant 4-bit vs 0.33 / 0.46 / 0.41 for
    affine 4-bit (group 64) on seeds 0 / 1 / 2."""
    for seed in range(3):
        ids = vlm_ids(300, seed)
        ref, r = vlm_greedy(tiny_vlm, ids, make_prompt_cache(tiny_vlm, kv_quant_scheme="fp16"), n=12)
        out, o = vlm_greedy(tiny_vlm, ids, make_prompt_cache(tiny_vlm, kv_bits=4, window=WINDOW), n=12)
        _, a = vlm_greedy(tiny_vlm, ids, make_prompt_cache(tiny_vlm, 4, "affine"), n=1)
        if seed != 1:
            assert out == ref, (seed, out, ref)
        err, affine_err = mx.abs(o - r).max().item(), mx.abs(a - r).max().item()
        assert 0 < err < min(0.35, affine_err), (seed, err, affine_err)
