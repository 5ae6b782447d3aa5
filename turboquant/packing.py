"""Pack b-bit codebook indices into ``uint32`` words.

Layout (fixed: the GPU kernels and the cache read it directly):
each vector's ``dim`` indices form one little-endian bitstream; index ``i``
occupies stream bits ``[i*b, i*b + b)``; stream bit ``k`` is bit ``k % 32`` of
word ``k // 32``.  An index may straddle two words (``b = 3``), the unused tail
bits of the last word are zero, and a vector takes
``packed_words(dim, b) = ceil(dim * b / 32)`` words.

The bitstream repeats every ``lcm(b, 32)`` bits, i.e. every ``G`` indices
filling ``W`` whole words (b=3: 32 indices in 3 words; b=4: 8 in 1).  Packing
works group by group with static shift tables, so it is a handful of
vectorised MLX ops whatever the number of tokens: no Python loop over
vectors, only over the ``W`` (<= b) words of one group.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np


def packed_words(dim: int, bits: int) -> int:
    """Number of uint32 words one vector of ``dim`` ``bits``-bit indices takes."""
    return (dim * bits + 31) // 32


@lru_cache(maxsize=None)
def _group(bits: int) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    """(G indices, W words, word of each index, bit shift, straddles?) for one period."""
    if not 1 <= bits <= 8:
        raise ValueError(f"packing supports 1..8 bits per index, got bits={bits}")
    period = math.lcm(bits, 32)
    g, w = period // bits, period // 32
    offsets = np.arange(g) * bits
    word = offsets // 32
    shift = offsets % 32
    straddle = shift + bits > 32
    return g, w, word, shift, straddle


def pack(indices: mx.array, bits: int) -> mx.array:
    """Pack integer ``indices`` [..., dim] (each < 2**bits) into uint32 [..., words]."""
    g, w, word, shift, straddle = _group(bits)
    dim = indices.shape[-1]
    lead = indices.shape[:-1]
    n_groups = -(-dim // g)
    x = indices.astype(mx.uint32)
    if n_groups * g != dim:
        pad = [(0, 0)] * len(lead) + [(0, n_groups * g - dim)]
        x = mx.pad(x, pad)
    x = x.reshape(*lead, n_groups, g)
    lo = x << mx.array(shift, dtype=mx.uint32)  # bits past 31 fall off: they go to `hi`
    if w == 1:
        words = lo.sum(axis=-1)[..., None]
    else:
        hi_shift = np.where(straddle, 32 - shift, 0)
        hi = mx.where(
            mx.array(straddle), x >> mx.array(hi_shift, dtype=mx.uint32), mx.array(0, mx.uint32)
        )
        cols = []
        for j in range(w):
            # Bits of different indices never overlap, so a sum is a bitwise OR.
            m_lo = mx.array(word == j)
            m_hi = mx.array(straddle & (word + 1 == j))
            cols.append(
                mx.where(m_lo, lo, 0).sum(axis=-1) + mx.where(m_hi, hi, 0).sum(axis=-1)
            )
        words = mx.stack(cols, axis=-1)
    words = words.astype(mx.uint32).reshape(*lead, n_groups * w)
    return words[..., : packed_words(dim, bits)]


def unpack(words: mx.array, bits: int, dim: int) -> mx.array:
    """Inverse of :func:`pack`: uint32 [..., words] -> uint8 indices [..., dim]."""
    g, w, word, shift, straddle = _group(bits)
    n_words = words.shape[-1]
    if n_words != packed_words(dim, bits):
        raise ValueError(
            f"unpack: got {n_words} words per vector, but dim={dim} at {bits} bits "
            f"needs {packed_words(dim, bits)}"
        )
    lead = words.shape[:-1]
    n_groups = -(-dim // g)
    x = words.astype(mx.uint32)
    if n_groups * w != n_words:
        x = mx.pad(x, [(0, 0)] * len(lead) + [(0, n_groups * w - n_words)])
    x = x.reshape(*lead, n_groups, w)
    mask = mx.array((1 << bits) - 1, dtype=mx.uint32)
    if w == 1:
        vals = (x >> mx.array(shift, dtype=mx.uint32)) & mask
    else:
        lo = mx.take(x, mx.array(word), axis=-1) >> mx.array(shift, dtype=mx.uint32)
        nxt = np.minimum(word + 1, w - 1)
        hi_shift = np.where(straddle, 32 - shift, 0)
        hi = mx.take(x, mx.array(nxt), axis=-1) << mx.array(hi_shift, dtype=mx.uint32)
        hi = mx.where(mx.array(straddle), hi, mx.array(0, mx.uint32))
        vals = (lo | hi) & mask
    return vals.reshape(*lead, n_groups * g)[..., :dim].astype(mx.uint8)
