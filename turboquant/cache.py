"""TurboQuantKVCache: a KV cache that stores old tokens as TurboQuant codes.

Layout per layer (``B`` batch, ``H`` kv heads, ``C`` capacity):

* ``keys_packed``   uint32  [B, H, C, words_k]  codebook indices, rotated domain
* ``keys_norms``    float16 [B, H, C]           corrected norms (see codec.py)
* ``values_packed`` / ``values_norms``           the same for values
* ``window_keys`` / ``window_values``           the exact tokens in the
  model's dtype, [B, H, sink_len + recent, D]: the attention sinks (the
  context's first ``sinks`` tokens), then the most recent tokens

With ``s = sink_len``: tokens ``[0, s)`` are the sinks, ``[s, s + packed_len)``
live in the packed arrays and ``[s + packed_len, offset)`` are the recent
window.  A token leaves the window lazily, at the *start* of the next
``update_and_fetch``: the chunk being processed therefore always attends to
itself (and the ``window`` tokens before it) exactly, and
``update_and_fetch`` returns the exact tokens (sinks + recent); the attention
(``turboquant.attention``) reads the packed history from the cache.
Attention does not depend on the order of its keys (positions are already
in them), so the sinks simply travel at the front of the exact tokens and
every attention route (reference, kernels, the fused step) covers them as
window tokens; only a mask over all columns has to be reordered
(``masks.split_mask``).  See ``policy`` for why sinks and how many.

Centring: keys and values are stored minus a per-(batch, head) mean taken
from every token seen at the first quantization (the sinks left out: their
keys are far from all others).  Real keys carry large
per-channel offsets; removing them shrinks the norms the codec has to spend
its bits on.  It is exact for attention: the packed scores get ``q·mean_k``
back (one dot per query row) and the packed value sum gets ``mass·mean_v``.
Each channel's mean is shrunk toward 0 by positive-part James-Stein
(``shrunk_mean``): on zero-mean data the estimate from the first tokens is
pure noise, and centring on it would bias the attention average (the lsq
reconstruction shrinks values toward the stored mean).

Quantizer: ``"scalar"`` (Lloyd-Max per coordinate, the GPU kernels' layout)
or ``"tcq"`` (``trellis.TrellisCodec``: same words and bytes, indices chosen
by a Viterbi search, ~0.7x the unit-vector MSE; reference path only).

Storage grows geometrically (x1.5, rounded up to ``step`` tokens) or exactly
to ``reserve(n)``, so appending ``n`` tokens costs O(n) copies in total.
There is deliberately no attribute called ``bits``: mlx-lm sends any cache
with ``bits`` to its affine quantized attention.

Masks from ``make_mask`` cover the columns ``update_and_fetch`` returns (the
exact tokens): the packed history precedes every query, so causal attention
sees all of it.  ``state`` is twelve arrays (None where empty) followed by
the meta strings, because mlx-lm's ``save_prompt_cache`` saves ``state``
only; the meta strings start with the format version (``FORMAT``), and a
cache saved in another format is refused with the version it carries.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from .attention import launchers
from .codec import PackedCodec, TurboQuantCodec
from .packing import packed_words
from .rotation import HadamardRotation
from .trellis import TrellisCodec
from .policy import QUANTIZERS, SINK_TOKENS, KVQuantPolicy, parse_kv_policy
from .rotary import Rotary

# Saved-cache format: bump whenever what the saved arrays mean changes.
# 2: 4-bit keys / 3-bit values at 3.5 (3 / 2 at 2.5) and attention sinks
# at the front of the exact tokens; format 1 (no version field) had neither.
# 3: keys may be centred on a turned pre-RoPE mean (key_mean_pre, rotary_theta).
# 4: ... or on its average over blocks of packed tokens (mean_blocks).
# 5: packed keys divided by a per-channel key scale (key_scale), and the
# query energy that calibrates it before the first flush (query_sumsq).
# 6: value scales unbiased (codec.stored_scale); a format-5 cache decodes the
# same way but holds the shrunken least-squares values, so a document cache
# hit would not equal a fresh prefill.
FORMAT = "tqcache-6"

def make_codecs(quantizer: str, key_bits: int, value_bits: int, rotation: HadamardRotation,
                value_rotation: HadamardRotation) -> tuple[PackedCodec, PackedCodec]:
    """The key and value codecs of a cache (dims from the rotations).

    Keys keep the least-squares scale (a logit's best estimate), values the
    unbiased one (attention averages them over many tokens: ``codec``'s
    docstring).  SmolLM2, window 0, 4,096 scored positions: 2.5 bits
    +24.2% -> +15.8% perplexity, 3.5 bits +3.65% -> +2.45%, 4 bits
    +1.35% -> +1.28% (docs/benchmarks.md).
    """
    codec = TrellisCodec if quantizer == "tcq" else TurboQuantCodec
    return (codec(rotation.dim, key_bits, rotation),
            codec(value_rotation.dim, value_bits, value_rotation, unbiased=True))


# The power of (E k^2 / E q^2) per channel that key_scale^2 follows, see
# TurboQuantKVCache._calibrate_key_scale.
KEY_SCALE_POWER = 0.25


def shrunk_mean(x: mx.array, axis: int = 2) -> mx.array:
    """Per-channel mean of ``x`` over ``axis`` (keepdims), shrunk toward 0.

    Positive-part James-Stein per channel: ``m * max(0, 1 - var / (n m²))``
    with ``var`` the channel's sample variance over the ``n`` tokens.  A mean
    that is within noise of zero (zero-mean data, ``m² ~ var/n``) is mostly
    dropped: centring on a noisy estimate would only bias the attention
    average toward it (the lsq reconstruction shrinks values toward the stored
    mean).  Real offsets (``|m| >> sigma/sqrt(n)``, e.g. outlier channels)
    are kept almost whole.
    """
    x = x.astype(mx.float32)
    n = x.shape[axis]
    m = mx.mean(x, axis=axis, keepdims=True)
    if n < 2:
        return m
    var = mx.var(x, axis=axis, keepdims=True, ddof=1)
    shrink = mx.maximum(1.0 - var / mx.maximum(n * m * m, 1e-30), 0.0)
    return m * shrink


def flush_count(exact: int, window: int, flush_batch: int) -> int:
    """Tokens an append packs when ``exact`` tokens beyond the sinks are held:
    all beyond the window once at least ``flush_batch`` of them wait (a
    prefill chunk always qualifies), else none.  The one rule for when
    tokens leave the exact window (a decode step's replay reads it too:
    ``benchmarks.quality``)."""
    excess = exact - window
    return excess if excess >= flush_batch else 0


def _drop(x: mx.array, start: int, n: int) -> mx.array:
    """``x`` without tokens ``[start, start + n)`` (axis 2)."""
    if start == 0:
        return x[:, :, n:]
    return mx.concatenate([x[:, :, :start], x[:, :, start + n :]], axis=2)


class TurboQuantKVCache(_BaseCache):
    """mlx-lm/mlx-vlm KV cache with TurboQuant-compressed history.

    Args:
        kv_bits: preset width (2, 2.5, 3, 3.5, 4); see ``policy.resolve_bits``.
        key_bits / value_bits: override either side (1..4 bits).
        window: number of most recent tokens kept exact (model dtype).
        sinks: number of first tokens of the context kept exact (model dtype).
        flush_batch: tokens beyond the window that wait to be quantized
            together (default ``window // 2``, at least 1).
        seed: rotation seed; ``make_prompt_cache`` passes base seed + layer.
        quantizer: ``"scalar"`` (Lloyd-Max, ``codec.TurboQuantCodec``; the GPU
            kernels' layout) or ``"tcq"`` (trellis-coded, ``trellis.TrellisCodec``:
            same bytes, lower error, slower to quantize, reference path only).
        policy / layer: the parsed options of ``make_prompt_cache`` (which
            then win over the arguments above), this cache's layer index
            (rotation seed ``policy.seed + layer``).
    """

    # The layer's RoPE angles (turboquant.rotary.Rotary; make_prompt_cache sets
    # them where the attention route adds q . R(p) mean back) and, once the
    # first token is packed, the pre-RoPE key mean the packed keys are centred
    # on, turned to each one's position.  Both travel in the saved state.
    # mean_blocks: the turned mean is averaged over blocks of
    # rotary.MEAN_BLOCK packed tokens (the form the GPU kernels add back).
    rotary = None
    key_mean_pre: Optional[mx.array] = None
    mean_blocks = False
    mean_pairs = 0  # rotary pairs turned per layer at the first flush (0: all)
    # Per-channel key scale [B, H, 1, D] fixed at the first flush from the
    # queries attention has seen until then (query_sumsq over query_rows rows
    # per head, both saved so a cache saved before its first flush still
    # calibrates): packed keys hold (centred key) / key_scale and their
    # scores read queries * key_scale.  None (no queries seen): unscaled.
    key_scale: Optional[mx.array] = None
    query_sumsq: Optional[mx.array] = None
    query_rows = 0

    step = 256  # capacity granularity in tokens
    growth = 1.5

    def __init__(
        self,
        kv_bits: float | None = 3.5,
        *,
        key_bits: int | None = None,
        value_bits: int | None = None,
        window: int = 128,
        flush_batch: int | None = None,
        seed: int = 0,
        quantizer: str = "scalar",
        sinks: int = SINK_TOKENS,
        policy: KVQuantPolicy | None = None,
        layer: int = 0,
    ):
        if policy is None:
            policy = parse_kv_policy(kv_bits, key_bits=key_bits, value_bits=value_bits, quantizer=quantizer,
                                     window=window, sinks=sinks, seed=seed, where="TurboQuantKVCache")
        self._use_policy(policy, layer)
        # Decode appends one token per step; quantizing each at once would
        # cost a launch pair per step, comparable to the attention itself.
        # Up to `flush_batch` tokens beyond the window wait and are
        # quantized together, which amortizes it.
        self._flush_batch = None if flush_batch is None else max(1, int(flush_batch))
        # True while a task decodes over a prefilled document: every token
        # appended stays exact, the packed document is never written (so a
        # task's rewind is a trim, and rows sharing the document match a task
        # run alone: turboquant.shared_prefix).
        self.hold = False
        self.offset = 0
        self.packed_len = 0
        self.keys_packed: Optional[mx.array] = None
        self.keys_norms: Optional[mx.array] = None
        self.values_packed: Optional[mx.array] = None
        self.values_norms: Optional[mx.array] = None
        self.window_keys: Optional[mx.array] = None
        self.window_values: Optional[mx.array] = None
        self.key_mean: Optional[mx.array] = None
        self.value_mean: Optional[mx.array] = None
        self.reallocations = 0  # storage (re)allocations, for tests and stats
        self._reserved = 0
        self._dims: Optional[tuple[int, int]] = None
        self.rotation = self.value_rotation = None
        self.key_codec = self.value_codec = None

    # ------------------------------------------------------------------ setup
    def _use_policy(self, policy: KVQuantPolicy, layer: int = 0) -> None:
        """Take the widths, quantizer, window and seed from ``policy``."""
        if policy.scheme != "turboquant":
            raise ValueError(f"TurboQuantKVCache: policy scheme {policy.scheme!r} is not turboquant")
        self.policy = policy
        self.key_bits, self.value_bits = policy.key_bits, policy.value_bits
        self.quantizer, self.window, self.sinks = policy.quantizer, policy.window, policy.sinks
        self.seed = policy.seed + int(layer)

    def _setup(self, k_dim: int, v_dim: int) -> None:
        """Build the rotation and codecs once the head dims are known.

        Keys and values share one rotation when their dims agree (as the
        design fixes); a model with different value dims gets a second
        rotation of its own size from the same seed.
        """
        self._dims = (k_dim, v_dim)
        self.rotation = HadamardRotation(k_dim, self.seed)
        self.value_rotation = (
            self.rotation if v_dim == k_dim else HadamardRotation(v_dim, self.seed)
        )
        self.key_codec, self.value_codec = make_codecs(
            self.quantizer, self.key_bits, self.value_bits, self.rotation, self.value_rotation)

    @property
    def flush_batch(self) -> int:
        """Tokens beyond the window that wait to be quantized together."""
        return self._flush_batch if self._flush_batch is not None else max(1, self.window // 2)

    @property
    def capacity(self) -> int:
        return 0 if self.keys_norms is None else self.keys_norms.shape[2]

    @property
    def window_len(self) -> int:
        """Exact tokens held: the sinks and the recent window."""
        return self.offset - self.packed_len

    @property
    def sink_len(self) -> int:
        """Attention sinks held (at the front of the exact tokens)."""
        return min(self.sinks, self.offset)

    def reserve(self, n_tokens: int) -> None:
        """Allocate packed storage for ``n_tokens`` up front (no regrowth).

        The pipeline knows each document's length before prefill; reserving
        makes the whole prefill run without a single reallocation.
        """
        self._reserved = max(self._reserved, int(n_tokens))
        if self.window_keys is not None and self._reserved > self.capacity:
            self._grow(self._reserved)

    def _grow(self, needed: int) -> None:
        cap = self.capacity
        if needed <= cap:
            return
        new_cap = max(needed, self._reserved, int(cap * self.growth))
        new_cap = -(-new_cap // self.step) * self.step
        B, H = self.window_keys.shape[:2]
        k_dim, v_dim = self._dims
        wk = packed_words(k_dim, self.key_bits)
        wv = packed_words(v_dim, self.value_bits)
        p = self.packed_len

        def grown(old: Optional[mx.array], shape: tuple, dtype: mx.Dtype) -> mx.array:
            new = mx.zeros(shape, dtype)
            if old is not None and p > 0:
                new[:, :, :p] = old[:, :, :p]
            return new

        self.keys_packed = grown(self.keys_packed, (B, H, new_cap, wk), mx.uint32)
        self.values_packed = grown(self.values_packed, (B, H, new_cap, wv), mx.uint32)
        self.keys_norms = grown(self.keys_norms, (B, H, new_cap), mx.float16)
        self.values_norms = grown(self.values_norms, (B, H, new_cap), mx.float16)
        self.reallocations += 1

    # --------------------------------------------------------------- protocol
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` [B, H, L, D]; return the exact tokens.

        First moves tokens that fell out of the window (from earlier calls)
        into packed storage, so what is returned is the sinks followed by a
        window that ends with the new tokens and holds at least
        ``min(window, offset - sinks)`` tokens before them.
        """
        if self._dims is None:
            self._setup(keys.shape[-1], values.shape[-1])
        self._flush()
        if self.window_keys is None or self.window_keys.shape[2] == 0:
            self.window_keys, self.window_values = keys, values
        else:
            self.window_keys = mx.concatenate([self.window_keys, keys], axis=2)
            self.window_values = mx.concatenate([self.window_values, values], axis=2)
        self.offset += keys.shape[2]
        return self.window_keys, self.window_values

    def _flush_len(self) -> int:
        """Tokens the next ``update_and_fetch`` moves to packed storage
        (:func:`flush_count`); none while ``hold``."""
        if self.window_keys is None or self.hold:
            return 0
        return flush_count(self.window_keys.shape[2] - self.sink_len, self.window, self.flush_batch)

    def settle(self, window: int | None = None) -> None:
        """Quantize every token beyond the newest ``window`` (default: the
        exact window) now, whatever ``flush_batch`` says (the last prefill
        chunk would otherwise wait for the next append; a task that ``hold``s
        would keep it exact for its whole decode)."""
        if self.window_keys is not None:
            keep = self.window if window is None else max(0, int(window))
            self._flush(self.window_keys.shape[2] - self.sink_len - keep)

    @property
    def mean_origin(self) -> Optional[int]:
        """Where the blocks of a block mean start (the first packed token's
        position), or None for the exact turned mean."""
        return self.sink_len if self.mean_blocks else None

    def turned_key_mean(self, start: int, stop: int) -> mx.array:
        """What the packed keys at positions ``start..stop-1`` are centred on
        (beyond ``key_mean``): ``R(p) key_mean_pre`` or its block average."""
        return self.rotary.turned(self.key_mean_pre, start, stop, self.mean_origin)

    def key_score_bias(self, q: mx.array, start: int, stop: int) -> mx.array:
        """``q . turned_key_mean`` [..., M, stop - start] (q unrotated, [..., M, D])."""
        return self.rotary.score_bias(q, self.key_mean_pre, start, stop, self.mean_origin)

    def block_key_means(self, n: int) -> mx.array:
        """Each block's full key mean (``key_mean`` + its turned mean)
        [B, H, ceil(n / MEAN_BLOCK), D] for packed tokens ``[0, n)`` of a
        block-mean cache: what dequantizing adds back per block."""
        from .rotary import MEAN_BLOCK

        nb = -(-n // MEAN_BLOCK)
        rows = self.rotary.block_table(self.sink_len, nb)[:nb]
        return self.key_mean.astype(mx.float32) + self.rotary.turn(self.key_mean_pre, rows)

    def key_block_bias(self, q: mx.array, n: int) -> mx.array:
        """``q . block mean`` [..., ceil(n / MEAN_BLOCK), M] for packed tokens
        ``[0, n)`` of a block-mean cache: the kernels' score term per block."""
        from .rotary import MEAN_BLOCK

        return self.rotary.block_bias(q, self.key_mean_pre, self.sink_len, -(-n // MEAN_BLOCK))

    @property
    def turned_pairs(self) -> Optional[tuple]:
        """The ``MEAN_PAIRS`` rotary pairs the fused step's compact table
        covers: every pair whose pre-RoPE mean is not zero (padded with
        others), or None where more than that many are (then the kernels
        read the full table).  One host read per cache."""
        from .rotary import MEAN_PAIRS

        m = self.key_mean_pre
        held = getattr(self, "_turned_pairs", None)
        if held is not None and held[0] is m:
            return held[1]
        import numpy as np

        h = self.rotary.dims // 2
        live = np.flatnonzero(self._pair_energy(m) > 0)
        pairs = None
        if len(live) <= MEAN_PAIRS <= h:
            rest = [j for j in range(h) if j not in set(live.tolist())]
            pairs = tuple(sorted(live.tolist() + rest[: MEAN_PAIRS - len(live)]))
        self._turned_pairs = (m, pairs)
        return pairs

    def _pair_energy(self, m: mx.array):
        """Each rotary pair's squared pre-RoPE mean, summed over batch and heads (NumPy [dims / 2])."""
        import numpy as np

        m1, m2, _ = self.rotary._halves(m.astype(mx.float32))
        return np.asarray((m1 * m1 + m2 * m2).sum(axis=(0, 1, 2)))

    def _top_pairs(self, m: mx.array) -> mx.array:
        """A 0/1 mask [D] over the layer's top ``mean_pairs`` rotary pairs by
        (m1^2 + m2^2) * Dirichlet factor^2, summed over batch and heads."""
        import numpy as np

        from .rotary import MEAN_BLOCK

        r = self.rotary
        th = np.asarray(r.theta, np.float64)
        dirichlet = np.where(np.abs(np.sin(th / 2)) < 1e-12, 1.0,
                             np.sin(MEAN_BLOCK * th / 2) / (MEAN_BLOCK * np.sin(th / 2) + 1e-300))
        energy = self._pair_energy(m) * dirichlet ** 2
        keep = np.zeros(r.dims // 2, np.float32)
        keep[np.argsort(-energy)[: self.mean_pairs]] = 1.0
        D = m.shape[-1]
        full = np.zeros(D, np.float32)
        if r.traditional:
            full[0:r.dims:2], full[1:r.dims:2] = keep, keep
        else:
            full[: r.dims // 2], full[r.dims // 2: r.dims] = keep, keep
        return mx.array(full)

    def observe_queries(self, queries: mx.array) -> None:
        """Accumulate the queries' per-channel energy until the first flush
        fixes ``key_scale`` from it (attention calls this before it reads)."""
        if self.key_mean is not None or self.window_keys is None:
            return
        B, _, _, D = queries.shape
        q = queries.astype(mx.float32).reshape(B, self.window_keys.shape[1], -1, D)
        self.add_query_energy((q * q).sum(axis=2), q.shape[2])

    def add_query_energy(self, sumsq: mx.array, rows: int) -> None:
        """``observe_queries`` from its sums: per-channel Σq² [B, H, D] over ``rows`` query rows per head."""
        if self.key_mean is not None:
            return
        self.query_sumsq = sumsq if self.query_sumsq is None else self.query_sumsq + sumsq
        self.query_rows += rows

    def _calibrate_key_scale(self, centred: mx.array) -> None:
        """``key_scale`` from the centred keys the means were taken over and
        the queries seen so far: s² ∝ sqrt(E k² / E q²) per channel minimizes the
        score error of a rotation-spread quantization error ((Σ a s²)(Σ b/s²),
        Cauchy-Schwarz), normalized to geometric mean 1.  ``KEY_SCALE_POWER``
        is half that optimum's: the bound assumes the error stays spread
        evenly, and on SmolLM2's real activations (benchmarks.quality, window
        0) a quarter reads KL 0.0254 / 0.0101 at 3.5 / 4 bits against 0.0260 /
        0.0112 at a half and 0.0292 / 0.0143 unscaled."""
        if self.query_sumsq is None:
            return
        a = self.query_sumsq / max(self.query_rows, 1)
        b = mx.mean(centred * centred, axis=2)
        s2 = (mx.maximum(b, 1e-12) / mx.maximum(a, 1e-12)) ** KEY_SCALE_POWER
        s2 = s2 / mx.exp(mx.mean(mx.log(s2), axis=-1, keepdims=True))
        s2 = mx.clip(s2, 1 / 16, 16)
        self.key_scale = mx.sqrt(s2)[:, :, None, :]
        self.query_sumsq, self.query_rows = None, 0

    def _centred_keys(self, start: int, count: int) -> mx.array:
        """Window keys ``start:start + count`` (float32) minus the key mean
        (constant, plus the turned pre-RoPE one where there is a rotary)."""
        k = self.window_keys[:, :, start : start + count].astype(mx.float32) - self.key_mean
        if self.rotary is not None:
            p = start + self.packed_len  # window index -> position
            k = k - self.turned_key_mean(p, p + count)
        return k

    def _flush(self, excess: int | None = None) -> None:
        """Quantize the tokens beyond the exact window (``excess`` of them,
        default :meth:`_flush_len`) into packed storage."""
        if self.window_keys is None:
            return
        excess = self._flush_len() if excess is None else excess
        if excess <= 0:
            return
        s = self.sink_len
        if self.key_mean is None:
            # All tokens seen so far but the sinks: the best estimate
            # available at the moment the first token is quantized, fixed
            # from then on (shrunk toward 0 where it is within noise, see
            # shrunk_mean).
            if self.rotary is not None:
                wk = self.window_keys[:, :, s:].astype(mx.float32)
                pos = mx.arange(s, s + wk.shape[2])
                self.key_mean_pre = shrunk_mean(self.rotary.rotate(wk, -pos), axis=2)
                self.key_mean = mx.zeros_like(self.key_mean_pre)
                if self.mean_blocks and self.mean_pairs:
                    # turn only the layer's top pairs by the energy a block
                    # mean removes (rotary.MEAN_PAIRS); a constant mean for the rest
                    self.key_mean_pre = self.key_mean_pre * self._top_pairs(self.key_mean_pre)
                    self.key_mean = shrunk_mean(wk - self.rotary.turned(self.key_mean_pre, s, s + wk.shape[2],
                                                                         self.mean_origin), axis=2)
            else:
                self.key_mean = shrunk_mean(self.window_keys[:, :, s:], axis=2)
            self.value_mean = shrunk_mean(self.window_values[:, :, s:], axis=2)
            # the scale from the same tokens as the means
            self._calibrate_key_scale(self._centred_keys(s, self.window_keys.shape[2] - s))
        old_k = self._centred_keys(s, excess)
        if self.key_scale is not None:
            old_k = old_k / self.key_scale
        old_v = self.window_values[:, :, s : s + excess].astype(mx.float32) - self.value_mean
        # The fused quantize kernel on a GPU, the codec (reference) elsewhere.
        k_packed, k_norms = launchers.quantize_any(old_k, self.key_codec)
        v_packed, v_norms = launchers.quantize_any(old_v, self.value_codec)
        p = self.packed_len
        self._grow(p + excess)
        self.keys_packed[:, :, p : p + excess] = k_packed
        self.keys_norms[:, :, p : p + excess] = k_norms
        self.values_packed[:, :, p : p + excess] = v_packed
        self.values_norms[:, :, p : p + excess] = v_norms
        self.packed_len = p + excess
        self.window_keys = _drop(self.window_keys, s, excess)
        self.window_values = _drop(self.window_values, s, excess)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: Optional[int] = None
    ) -> Any:
        """Mask for the next ``N`` queries, over the keys ``update_and_fetch`` returns.

        Without a sliding window the packed history is entirely in the past
        of every query, so the mask only needs the window's columns (what
        the model sees as ``keys``; mlx-vlm slices masks to that length).
        With ``window_size`` the mask covers all ``offset + N`` columns (in
        position order) and the attention splits it (``masks.split_mask``).
        """
        if window_size is not None:
            return create_causal_mask(N, self.offset, window_size=window_size)
        if N == 1 and not return_array:
            return None
        kept = self.window_len - self._flush_len()  # window left after the flush
        if return_array:
            return create_causal_mask(N, kept)
        return "causal"

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.window_keys is None and self.packed_len == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens; trimming into packed history just lowers
        ``packed_len`` (the pipeline trims back to the document after each task)."""
        n = min(self.offset, int(n))
        new_offset = self.offset - n
        sinks = min(self.sinks, new_offset)
        self.packed_len = min(self.packed_len, new_offset - sinks)
        # the exact tokens kept: the sinks, then the recent tokens left (none
        # when the sinks themselves are trimmed: nothing is packed then)
        keep = new_offset - self.packed_len
        if self.window_keys is not None:
            self.window_keys = self.window_keys[:, :, :keep]
            self.window_values = self.window_values[:, :, :keep]
        self.offset = new_offset
        return n

    _CHECKPOINT_ATTRS = ("offset", "packed_len", "window_keys", "window_values", "key_mean", "key_mean_pre",
                         "value_mean", "key_scale", "query_sumsq", "query_rows", "hold")

    def checkpoint(self) -> dict:
        """A cheap marker to come back to with ``restore`` (references, no copies).

        ``trim`` alone cannot undo a flush: tokens that left the exact window
        while later tokens were appended stay quantized.  The packed storage
        below ``packed_len`` is never rewritten, so remembering the counters,
        the window arrays and the means is enough to get back bit-exactly
        (the pipeline prefills a document once and returns here after each task).
        """
        return {name: getattr(self, name) for name in self._CHECKPOINT_ATTRS}

    def restore(self, checkpoint: dict) -> None:
        """Return to ``checkpoint`` (taken on this cache, with nothing trimmed below it since)."""
        for name, value in checkpoint.items():
            setattr(self, name, value)

    # ----------------------------------------------------------------- memory
    @property
    def nbytes(self) -> int:
        """Bytes *allocated*: packed storage at full capacity, the window and
        the means.  ``used_nbytes`` counts only what holds tokens."""
        arrays = (
            self.keys_packed, self.keys_norms, self.values_packed, self.values_norms,
            self.window_keys, self.window_values, self.key_mean, self.key_mean_pre, self.value_mean,
            self.key_scale,
        )
        return sum(a.nbytes for a in arrays if a is not None)

    @property
    def used_nbytes(self) -> int:
        """Bytes holding the ``offset`` cached tokens (packed + window + means)."""
        total = 0
        if self.keys_packed is not None and self.capacity:
            per_token = sum(
                a.nbytes // a.shape[2]
                for a in (self.keys_packed, self.keys_norms, self.values_packed, self.values_norms)
            )
            total += per_token * self.packed_len
        for a in (self.window_keys, self.window_values, self.key_mean, self.key_mean_pre, self.value_mean,
                  self.key_scale):
            if a is not None:
                total += a.nbytes
        return total

    # ------------------------------------------------------------------ state
    _ARRAYS = (
        "window_keys", "window_values", "keys_packed", "keys_norms",
        "values_packed", "values_norms", "key_mean", "value_mean",
        "key_mean_pre", "rotary_theta", "key_scale", "query_sumsq",
    )

    @property
    def rotary_theta(self) -> Optional[mx.array]:
        """The RoPE angles the keys were centred with (saved with the cache)."""
        return None if self.rotary is None else self.rotary.theta

    @property
    def state(self) -> tuple:
        """Twelve array slots (None where empty) followed by the meta strings.

        mlx-lm's ``save_prompt_cache`` saves only ``state`` and rebuilds with
        ``from_state(state)``, so the meta data has to travel inside it;
        mlx-vlm evaluates ``c.state`` after each chunk, which skips the
        strings.  Packed arrays are sliced to ``packed_len`` (views)."""
        p = self.packed_len
        arrays = []
        for name in self._ARRAYS:
            a = getattr(self, name)
            if a is not None and name in ("keys_packed", "keys_norms", "values_packed", "values_norms"):
                a = a[:, :, :p]
            arrays.append(a)
        return tuple(arrays) + self.meta_state

    @state.setter
    def state(self, v) -> None:
        v = tuple(v)
        if len(v) > len(self._ARRAYS):  # arrays + meta strings
            self.meta_state = v[len(self._ARRAYS) :]
            v = v[: len(self._ARRAYS)]
        if len(v) != len(self._ARRAYS):
            raise ValueError(
                f"TurboQuantKVCache.state: expected {len(self._ARRAYS)} arrays "
                f"(+ meta), got {len(v)} entries"
            )
        theta = None
        for name, a in zip(self._ARRAYS, v):
            if a is not None and a.size == 0 and name not in ("window_keys", "window_values"):
                a = None  # mlx-lm saves None as an empty array
            if name == "rotary_theta":  # the angles; with meta's dims, the cache's Rotary
                theta = a
            else:
                setattr(self, name, a)
        dims, traditional = getattr(self, "_rotary_meta", (0, False))
        self.rotary = None if theta is None or not dims else Rotary(theta.astype(mx.float32), dims, traditional).canonical()

    @property
    def meta_state(self) -> tuple[str, ...]:
        dims = self._dims or (0, 0)
        return (FORMAT,) + tuple(
            str(x)
            for x in (
                self.key_bits, self.value_bits, self.window, self.sinks, self.seed,
                self.offset, self.packed_len, dims[0], dims[1], self.quantizer,
                0 if self.rotary is None else self.rotary.dims,
                int(self.rotary is not None and self.rotary.traditional),
                int(bool(self.mean_blocks)), self.query_rows,
            )
        )

    @meta_state.setter
    def meta_state(self, v) -> None:
        v = tuple(str(x) for x in v)
        if not v or v[0] != FORMAT:
            found = v[0] if v and v[0].startswith("tqcache-") else "tqcache-1 (no version field)"
            raise ValueError(
                f"TurboQuantKVCache: this saved cache has format {found}; this tqpipe reads "
                f"{FORMAT} only (what the saved arrays hold changed: value scales unbiased since "
                "tqcache-6, keys scaled per channel since tqcache-5); prefill the document again to rebuild it"
            )
        if len(v) != 15:
            raise ValueError(f"TurboQuantKVCache: {FORMAT} meta state has 15 fields, got {len(v)}")
        quantizer = v[10]
        if quantizer not in QUANTIZERS:
            raise ValueError(
                f"TurboQuantKVCache: saved quantizer {quantizer!r}; expected one of {QUANTIZERS}"
            )
        kb, vb, window, sinks, seed, offset, packed_len, k_dim, v_dim = (int(x) for x in v[1:10])
        self._use_policy(KVQuantPolicy(key_bits=kb, value_bits=vb, quantizer=quantizer, window=window,
                                       sinks=sinks, seed=seed))
        self._flush_batch = None  # a scheduling choice, not saved: the default
        self.hold = False
        self.offset, self.packed_len = offset, packed_len
        self.reallocations, self._reserved = 0, 0
        self._dims = None
        self.rotation = self.value_rotation = self.key_codec = self.value_codec = None
        if k_dim:
            self._setup(k_dim, v_dim)
        self._rotary_meta = (int(v[11]), bool(int(v[12])))
        self.mean_blocks = bool(int(v[13]))
        self.query_rows = int(v[14])

    @classmethod
    def from_state(cls, state, meta_state=None) -> "TurboQuantKVCache":
        """Rebuild a cache (mlx-lm passes ``state``; mlx-vlm also ``meta_state``)."""
        obj = cls.__new__(cls)
        if meta_state is not None:
            obj.meta_state = meta_state
        obj.state = state
        return obj
