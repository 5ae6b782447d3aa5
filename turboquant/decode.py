"""Block decoders: packed words -> unit-scale codebook values, for the CPU attention.

Why a module of its own: this is the hot loop of decode on the CPU (the
pure-MLX path), and MLX's CPU backend rewards a particular style -- fused
elementwise kernels (~0.2 ns per op and element) and no gathers (~9 ns per
element), slices or concatenates in the per-element work.  So:

* indices are read in the :class:`~turboquant.packing.SlotLayout` (one
  shift and mask of a broadcast window per index; at 3 bits the slot axis
  carries pad slots, which the attention zeroes in the query and drops
  from the value sum once per call);
* codebook values come from a select tree over the index bits
  (``lookup.select_tree``), compiled with the unpacking into one kernel;
* TCQ's parities and its sign-magnitude codes are computed on the packed
  *words* (``_sign_magnitude_fn``: ~1/8 of the elements), then read out
  like indices; the union codebook is symmetric, so the lookup is a tree
  over |C| (2^b leaves, not 2^(b+1)) and a sign: at 4 bits a 32-leaf tree
  does not fit one fused CPU kernel (MLX splits it, ~20x slower), a
  16-leaf one does.

Measured (``python -m benchmarks.codec --decode-only``, 16k tokens, 8 kv
heads, d=128, this 2-core CPU): TCQ 3.5-bit attention went from ~0.9-1.06x
the time of fp16 SDPA to ~0.7x; the scalar 3-bit decode got ~1.7x faster
(no straddling-index concatenates).

``BlockDecoder.codes(words)`` returns float32 ``[..., slots]``; the true
unit codes are ``codes - offsets`` (TCQ's per-position start offsets, in
slot layout, or None), which the attention folds into scores and sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .codebooks import codebook
from .lookup import select_tree
from .packing import SlotLayout, packed_words, slot_layout


@dataclass(frozen=True)
class BlockDecoder:
    """How one code layout decodes (see the module docstring)."""

    layout: SlotLayout
    codes: Callable[[mx.array], mx.array]  # words [..., words] -> float32 [..., slots]
    offsets: Optional[mx.array]  # float32 [slots] or None

    def dense(self, words: mx.array) -> mx.array:
        """The true unit codes float32 [..., dim] (offsets applied; not the hot path)."""
        c = self.codes(words)
        if self.offsets is not None:
            c = c - self.offsets
        return self.layout.from_slots(c)


def _slot_shape(layout: SlotLayout, words: mx.array, out: mx.array) -> mx.array:
    return out.reshape(*words.shape[:-1], layout.slots)


@lru_cache(maxsize=None)
def _scalar_fn(bits: int, dim: int, leaves: tuple[float, ...]):
    layout = slot_layout(bits, dim)
    sh = mx.array(layout.shifts)
    mask = mx.array((1 << bits) - 1, mx.uint32)

    def lookup(w):
        return select_tree((w >> sh) & mask, leaves, bits)

    fn = mx.compile(lookup, shapeless=True)
    return lambda words: _slot_shape(layout, words, fn(layout.windows(words)))


def symmetric_half(levels: tuple[float, ...]) -> tuple[float, ...]:
    """The upper half of a symmetric codebook (``C[n-1-j] == -C[j]``), or a ValueError."""
    c = np.asarray(levels, np.float64)
    if not np.allclose(c, -c[::-1], rtol=0, atol=1e-6 * max(1.0, np.abs(c).max())):
        raise ValueError("TCQ decode needs a symmetric union codebook (C[n-1-j] == -C[j])")
    return tuple(levels[len(levels) // 2:])


def _field_masks(bits: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-word masks (uint32 [words]) of each index's low bit and top bit."""
    n = packed_words(dim, bits)
    low, top = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
    for i in range(dim):
        o, t = i * bits, i * bits + bits - 1
        low[o // 32] |= np.uint64(1 << (o % 32))
        top[t // 32] |= np.uint64(1 << (t % 32))
    return low.astype(np.uint32), top.astype(np.uint32)


@lru_cache(maxsize=None)
def _sign_magnitude_fn(bits: int, dim: int, taps: int):
    """Compiled word-level map: packed indices -> packed sign-magnitude codes.

    For index ``i`` with parity ``p_i`` the union code is ``j = 2 idx + p``
    (``bits + 1`` bits, top bit ``t`` = the index's top bit); with ``C``
    symmetric, ``C[j] = A[m]`` if ``t`` else ``-A[m]``, ``A`` the upper half
    and ``m = (j XOR (t ? 0 : ~0)) & (2^bits - 1)``, i.e. bit 0 of ``m`` is
    ``p XOR !t`` and bit ``k`` is ``idx_{k-1} XOR !t``.  All of that is
    bit-parallel on the words: shift the stream left by one (the top bit
    falls out of each field into the next one's low bit, which is replaced
    by the parity), XOR with !t spread over each field.  The result has the
    index layout (so the same windows read it); the sign stays in the
    original words' top bits.
    """
    low, top = _field_masks(bits, dim)
    top_next = np.append(top[1:], np.uint32(0))  # the next word's masks (for carries)
    L, H, Hn, notL = (mx.array(v) for v in (low, top, top_next, ~low))
    # p_i is the XOR over taps t of branch bit b_{i-1-t} = stream bit
    # bits*(i-1-t): shifting the stream left by bits*(t+1) moves it to bit
    # bits*i (the other bits of pw are junk and never read).
    lags = [bits * (t + 1) for t in range(taps.bit_length()) if (taps >> t) & 1]
    if max(lags) > 32:
        raise ValueError(f"TCQ decode: a tap lag of {max(lags)} bits spans more than one word")

    def fn(x, prev, nxt):
        pw = None  # parities: bit bits*i is p_i
        for s in lags:
            v = prev if s == 32 else (x << s) | (prev >> (32 - s))
            pw = v if pw is None else pw ^ v
        shifted = (x << 1) | (prev >> 31)
        nt, nt_next = ~x & H, ~nxt & Hn
        spread = nt
        for k in range(1, bits):
            spread = spread | (nt >> k) | (nt_next << (32 - k))
        return ((shifted & notL) | (pw & L)) ^ spread

    return mx.compile(fn, shapeless=True)


@lru_cache(maxsize=None)
def _tcq_fn(bits: int, dim: int, levels: tuple[float, ...], taps: int):
    """words -> float32 [..., slots]: sign-magnitude words, a 2^bits-leaf tree, a sign.

    Three kernels, measured fastest on CPU (4-bit, 256 tokens x 8 heads):
    adding the sign inside the tree's kernel made MLX split it badly (~7x
    slower), a ``where`` on two full arrays is ~10x a multiply.
    """
    layout = slot_layout(bits, dim)
    half = symmetric_half(levels)
    words_fn = _sign_magnitude_fn(bits, dim, taps)
    sh = mx.array(layout.shifts)
    sh_top = mx.array(layout.shifts + np.uint32(bits - 1))
    mask, one = mx.array((1 << bits) - 1, mx.uint32), mx.array(1, mx.uint32)
    f_one, f_two = mx.array(1.0, mx.float32), mx.array(2.0, mx.float32)

    def magnitude(w):
        return select_tree((w >> sh) & mask, half, bits)

    def signed(v, w):
        return v * (((w >> sh_top) & one).astype(mx.float32) * f_two - f_one)

    f_mag, f_sign = mx.compile(magnitude, shapeless=True), mx.compile(signed, shapeless=True)

    def codes(words):
        x = words.astype(mx.uint32)
        padded = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(1, 1)])  # a zero word on each side
        m = words_fn(x, padded[..., :-2], padded[..., 2:])  # (x, previous word, next word)
        v = f_sign(f_mag(layout.windows(m)), layout.windows(x))
        return _slot_shape(layout, words, v)

    return codes


@lru_cache(maxsize=None)
def block_decoder(key: tuple) -> BlockDecoder:
    """The decoder of a code key (``attention.code_key``: scalar or TCQ)."""
    if key[0] == "scalar":
        _, bits, dim = key
        leaves = tuple(float(c) for c in codebook(bits, dim).centroids)
        return BlockDecoder(slot_layout(bits, dim), _scalar_fn(bits, dim, leaves), None)
    if key[0] == "tcq":
        _, bits, dim, taps, levels, offsets = key
        layout = slot_layout(bits, dim)
        off = None
        if offsets is not None and any(offsets):
            off = layout.to_slots(mx.array(np.asarray(offsets, np.float32)))
        return BlockDecoder(layout, _tcq_fn(bits, dim, tuple(levels), taps), off)
    raise ValueError(f"block_decoder: unknown code layout {key[0]!r}")
