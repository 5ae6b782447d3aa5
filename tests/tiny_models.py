"""Tiny seeded mlx-lm models for cache/attention tests (no downloads)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map


def seeded(model: nn.Module, seed: int, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """Re-initialise every weight from ``seed`` (normal, std 1/sqrt(fan_in))
    so the model is identical on every run and machine; float32 on CPU."""
    mx.random.seed(seed)

    def init(p: mx.array) -> mx.array:
        if p.ndim == 1:  # norms: ones keep activations in range
            return mx.ones(p.shape, dtype)
        return (mx.random.normal(p.shape) / p.shape[-1] ** 0.5).astype(dtype)

    model.update(tree_map(init, model.parameters()))
    mx.eval(model.parameters())
    return model


def tiny_llama(seed: int = 0, **overrides) -> nn.Module:
    """2-layer llama, 4 query heads / 2 kv heads, head_dim 64, vocab 256."""
    from mlx_lm.models import llama

    args = dict(
        model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        rope_theta=10000.0, tie_word_embeddings=False,
    )
    args.update(overrides)
    return seeded(llama.Model(llama.ModelArgs(**args)), seed)


def prompt_tokens(n: int, seed: int = 1, vocab: int = 256) -> mx.array:
    """A deterministic pseudo-text prompt: a short random phrase repeated with
    variations, so attention has real structure (copying) to get right."""
    mx.random.seed(seed)
    phrase = mx.random.randint(0, vocab, (23,))
    reps = -(-n // 23)
    toks = mx.tile(phrase, (reps,))[:n]
    noise = mx.random.randint(0, vocab, (n,))
    keep = mx.random.uniform(shape=(n,)) < 0.8
    return mx.where(keep, toks, noise).astype(mx.int32)
