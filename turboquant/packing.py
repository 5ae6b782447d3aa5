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
from dataclasses import dataclass
from functools import cached_property, lru_cache

import mlx.core as mx
import numpy as np


def packed_words(dim: int, bits: int) -> int:
    """Number of uint32 words one vector of ``dim`` ``bits``-bit indices takes."""
    return (dim * bits + 31) // 32


@lru_cache(maxsize=None)
def _tables(bits: int) -> tuple[int, int, list[tuple[int, int, np.ndarray, np.ndarray]], np.ndarray]:
    """Static shift tables for one period of ``G`` indices in ``W`` words.

    Word ``j`` of a period holds a contiguous run of indices ``[a, e)``; each
    moves left by ``max(rel, 0)`` or right by ``max(-rel, 0)`` where ``rel`` is
    its bit offset relative to the word (negative for the high part of an
    index that straddles in from the previous word).  Runs are contiguous, so
    packing and unpacking use slices and broadcasts only -- MLX's CPU gather
    (``take``) is ~8x slower than the whole rest of the computation.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"packing supports 1..8 bits per index, got bits={bits}")
    period = math.lcm(bits, 32)
    g, w = period // bits, period // 32
    offsets = np.arange(g) * bits
    runs = []
    for j in range(w):
        users = np.nonzero((offsets < 32 * (j + 1)) & (offsets + bits > 32 * j))[0]
        rel = offsets[users] - 32 * j
        runs.append(
            (int(users[0]), int(users[-1]) + 1,
             np.maximum(rel, 0).astype(np.uint32), np.maximum(-rel, 0).astype(np.uint32))
        )
    return g, w, runs, offsets


def _as_groups(x: mx.array, n_groups: int, width: int) -> mx.array:
    """uint32 ``x`` [..., n] zero-padded to ``n_groups * width`` and viewed as [..., n_groups, width]."""
    lead, n = x.shape[:-1], x.shape[-1]
    x = x.astype(mx.uint32)
    if n_groups * width != n:
        x = mx.pad(x, [(0, 0)] * len(lead) + [(0, n_groups * width - n)])
    return x.reshape(*lead, n_groups, width)


def pack(indices: mx.array, bits: int) -> mx.array:
    """Pack integer ``indices`` [..., dim] (each < 2**bits) into uint32 [..., words]."""
    g, w, runs, _ = _tables(bits)
    dim = indices.shape[-1]
    lead = indices.shape[:-1]
    n_groups = -(-dim // g)
    x = _as_groups(indices, n_groups, g)
    cols = []
    for a, e, left, right in runs:
        v = x[..., a:e] << mx.array(left)  # bits pushed past 31 belong to the next word
        if right.any():
            v = v >> mx.array(right)
        cols.append(v.sum(axis=-1, keepdims=True))  # disjoint bits: sum == OR
    words = cols[0] if w == 1 else mx.concatenate(cols, axis=-1)
    words = words.astype(mx.uint32).reshape(*lead, n_groups * w)
    return words[..., : packed_words(dim, bits)]


def unpack(words: mx.array, bits: int, dim: int) -> mx.array:
    """Inverse of :func:`pack`: uint32 [..., words] -> uint8 indices [..., dim]."""
    g, w, runs, offsets = _tables(bits)
    n_words = words.shape[-1]
    if n_words != packed_words(dim, bits):
        raise ValueError(
            f"unpack: got {n_words} words per vector, but dim={dim} at {bits} bits "
            f"needs {packed_words(dim, bits)}"
        )
    lead = words.shape[:-1]
    n_groups = -(-dim // g)
    x = _as_groups(words, n_groups, w)
    mask = mx.array((1 << bits) - 1, dtype=mx.uint32)
    parts = []
    for j in range(w):
        # Indices whose low bit lies in word j: shift right by their offset.
        mine = np.nonzero(offsets // 32 == j)[0]
        shift = (offsets[mine] % 32).astype(np.uint32)
        lo = x[..., j : j + 1] >> mx.array(shift)
        if j + 1 < w and offsets[mine[-1]] % 32 + bits > 32:
            # The last one straddles: its high bits are the low bits of word j+1.
            spill = 32 - int(shift[-1])
            hi = x[..., j + 1 : j + 2] << spill
            lo = mx.concatenate([lo[..., :-1], lo[..., -1:] | hi], axis=-1)
        parts.append(lo)
    vals = (parts[0] if w == 1 else mx.concatenate(parts, axis=-1)) & mask
    return vals.reshape(*lead, n_groups * g)[..., :dim].astype(mx.uint8)


# ---------------------------------------------------------------- slot layout
@dataclass(frozen=True)
class SlotLayout:
    """A gather-free view of one vector's packed indices, for the CPU decode.

    Why: on MLX's CPU backend a gather costs ~9 ns per element and every
    slice or concatenate ends a fused kernel, while a fused elementwise op
    costs ~0.2 ns.  So the stream is read through 32-bit *windows*: at
    b = 1, 2, 4 the words themselves (no index straddles a word), otherwise
    windows starting every 16 bits (word ``w`` and the funnel
    ``(word_w >> 16) | (word_{w+1} << 16)``), so that a field of ``b <= 16``
    bits at stream offset ``o`` lies wholly inside window ``o // stride``.
    Then index = ``(window >> (o % stride)) & mask``: one broadcast of the
    windows ``[..., n_windows, 1]`` against a constant shift table
    ``[n_windows, per]``.  At b = 1, 2, 4 every window holds ``per``
    indices and the slots are the indices in order; at b = 3 windows hold
    5 or 6 of ``per`` = 6, so the slot axis has pad slots (144 slots for
    dim 128).  Pad slots decode to some codebook value: callers zero the
    query there and drop them from value sums (:meth:`to_slots` /
    :meth:`from_slots`).
    """

    bits: int
    dim: int
    stride: int  # bits between window starts: 32 (windows = words) or 16 (plus funnels)
    n_windows: int
    per: int
    shifts: np.ndarray  # uint32 [n_windows, per]
    index: np.ndarray  # int64 [n_windows * per]: the index in each slot, -1 for a pad slot

    @property
    def slots(self) -> int:
        return self.n_windows * self.per

    @cached_property
    def identity(self) -> bool:
        """Slots are exactly the indices 0..dim-1 in order (no pad)."""
        return self.slots == self.dim and bool(np.all(self.index == np.arange(self.dim)))

    @cached_property
    def _slot_sources(self) -> mx.array:
        """For each slot, its index, or ``dim`` (a zero column) for a pad slot."""
        return mx.array(np.where(self.index < 0, self.dim, self.index))

    @cached_property
    def _index_slots(self) -> mx.array:
        """For each index 0..dim-1, the slot holding it."""
        real = np.nonzero(self.index >= 0)[0]
        return mx.array(real[np.argsort(self.index[real])])

    def windows(self, words: mx.array) -> mx.array:
        """uint32 words [..., words] -> windows [..., n_windows, 1] (word-level ops only)."""
        x = words.astype(mx.uint32)
        if self.stride == 32:
            return x[..., None]
        nxt = mx.pad(x[..., 1:], [(0, 0)] * (x.ndim - 1) + [(0, 1)])
        funnel = (x >> 16) | (nxt << 16)
        return mx.stack([x, funnel], axis=-1).reshape(*x.shape[:-1], self.n_windows, 1)

    def to_slots(self, x: mx.array) -> mx.array:
        """[..., dim] -> [..., slots] with zeros in pad slots (for queries, offsets)."""
        if self.identity:
            return x
        xz = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 1)])
        return mx.take(xz, self._slot_sources, axis=-1)

    def from_slots(self, x: mx.array) -> mx.array:
        """[..., slots] -> [..., dim] (drops pad slots; for one decode's accumulator)."""
        if self.identity:
            return x
        return mx.take(x, self._index_slots, axis=-1)


@lru_cache(maxsize=None)
def slot_layout(bits: int, dim: int) -> SlotLayout:
    """The :class:`SlotLayout` of ``dim`` indices of ``bits`` bits (1..16)."""
    if not 1 <= bits <= 16:
        raise ValueError(f"slot_layout supports 1..16 bits per index, got bits={bits}")
    stride = 32 if 32 % bits == 0 else 16
    n_windows = packed_words(dim, bits) * (32 // stride)
    per = -(-stride // bits)
    shifts = np.zeros((n_windows, per), np.uint32)
    index = np.full((n_windows, per), -1, np.int64)
    fill = np.zeros(n_windows, np.int64)
    for i in range(dim):
        o = i * bits
        a = o // stride
        shifts[a, fill[a]] = o % stride
        index[a, fill[a]] = i
        fill[a] += 1
    return SlotLayout(bits, dim, stride, n_windows, per, shifts, index.reshape(-1))
