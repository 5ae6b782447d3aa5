"""KV cache sizes a user can trust: the cache's bytes next to fp16's for the same tokens.

A compressed cache's size means little alone.  TurboQuant keeps the most
recent ``window`` tokens exact in the model's dtype (float32 on the CPU
path) and packs only older ones, so a short document is held entirely in
the window and takes *more* than fp16; a long one approaches
``kv_bits / 16`` of fp16.  Every figure is therefore reported with the fp16
bytes for the same tokens and how many tokens are still exact, so the saving
(or its absence) is explicit at every length.

``KVGeometry`` is read from the model's ``config.json`` (no weights), so
``--dry-run`` and the report can use the same formulas a run measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from turboquant.packing import packed_words
from turboquant.policy import SINK_TOKENS
from turboquant.widths import resolve_bits

FP16_BYTES = 2
AFFINE_GROUP = 64  # mlx QuantizedKVCache default group size: one scale and one bias per group


@dataclass(frozen=True)
class KVGeometry:
    """What sets a KV cache's size: layers x KV heads x (key dim + value dim) per token."""

    layers: int
    kv_heads: int
    k_dim: int
    v_dim: int

    @classmethod
    def from_config(cls, config: dict | None) -> "KVGeometry | None":
        """From an HF-style ``config.json`` (a VLM's ``text_config`` when present); None if it lacks the sizes."""
        if not config:
            return None
        cfg = {**config, **(config.get("text_config") or {})}
        try:
            heads = int(cfg["num_attention_heads"])
            dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
            return cls(int(cfg["num_hidden_layers"]), int(cfg.get("num_key_value_heads") or heads), dim, dim)
        except (KeyError, TypeError, ValueError):
            return None

    def fp16_nbytes(self, tokens: int) -> int:
        """Bytes an fp16 cache holds for ``tokens`` tokens (no slack)."""
        return tokens * self.layers * self.kv_heads * (self.k_dim + self.v_dim) * FP16_BYTES


def cache_nbytes_formula(geom: KVGeometry, spec: Any, tokens: int, *, exact_bytes: int = FP16_BYTES) -> int:
    """Bytes the job's cache holds for ``tokens`` tokens once settled (the
    engine settles a TurboQuant cache before its first task, so records report this).

    TurboQuant: the first ``SINK_TOKENS`` (attention sinks) and the last
    ``window`` tokens exact at ``exact_bytes`` per element, the others packed
    (indices + one fp16 norm per vector), plus the float32 centring means
    and key scale.  Affine: ``kv_bits`` per element plus a
    scale and bias per group.  fp16: the model's dtype (``exact_bytes``:
    float32 on the CPU path, where even the "fp16" scheme holds 4 bytes).
    """
    per_head = geom.layers * geom.kv_heads
    scheme = spec.kv_quant_scheme
    if scheme == "turboquant":
        kb, vb = resolve_bits(spec.kv_bits, spec.key_bits, spec.value_bits)
        exact = min(tokens, spec.window + SINK_TOKENS)
        packed = tokens - exact
        packed_tok = 4 * (packed_words(geom.k_dim, kb) + packed_words(geom.v_dim, vb)) + 2 * FP16_BYTES
        exact_tok = (geom.k_dim + geom.v_dim) * exact_bytes
        means = 4 * (2 * geom.k_dim + geom.v_dim) if packed else 0  # means, key scale: set by the first packing
        return per_head * (packed * packed_tok + exact * exact_tok + means)
    if scheme == "affine":
        bits = int(spec.kv_bits)
        per_vec = sum(d * bits // 8 + 2 * exact_bytes * -(-d // AFFINE_GROUP) for d in (geom.k_dim, geom.v_dim))
        return per_head * tokens * per_vec
    return per_head * tokens * (geom.k_dim + geom.v_dim) * exact_bytes  # "fp16" holds the model's dtype


def exact_tokens(cache: list) -> int | None:
    """Tokens the first layer still holds uncompressed (TurboQuant's sinks and window), else None."""
    first = cache[0] if cache else None
    return int(first.window_len) if first is not None and hasattr(first, "window_len") else None


def figures(nbytes: int, tokens: int, geom: KVGeometry | None) -> dict:
    """``{tokens, fp16_nbytes, vs_fp16}`` for a measured ``nbytes`` (geometry unknown: tokens only)."""
    out: dict = {"tokens": tokens}
    if geom is not None:
        fp16 = geom.fp16_nbytes(tokens)
        out["fp16_nbytes"] = fp16
        out["vs_fp16"] = round(nbytes / fp16, 4) if fp16 else None
    return out


def describe(cache: dict) -> str:
    """One log phrase for a record's ``cache`` field, e.g.
    ``12.6 MiB for 287 tokens (turboquant; fp16 6.3 MiB, 2.00x; 287 still exact)``."""
    mib = cache["nbytes_after_prefill"] / 2**20
    text = f"{mib:.1f} MiB"
    if "tokens" in cache:
        text += f" for {cache['tokens']} tokens"
    bits = [cache["scheme"]]
    if cache.get("fp16_nbytes"):
        bits.append(f"fp16 {cache['fp16_nbytes'] / 2**20:.1f} MiB, {cache['vs_fp16']:.2f}x")
    if cache.get("exact_tokens") is not None:
        bits.append(f"{cache['exact_tokens']} still exact")
    return f"{text} ({'; '.join(bits)})"
