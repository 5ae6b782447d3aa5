"""A model's rotary position embedding as angles, so a cache can turn vectors itself.

Keys reach the cache after RoPE.  Their per-channel offset is fixed before
RoPE, so after it the offset turns with the position; a cache that centres
keys on ``R(p) mean`` (the pre-RoPE mean turned to each token's position)
removes it where a constant mean cannot (SmolLM2: 1.5-3.6x less residual
key energy per layer).  Centring is exact for attention with any angles (the
scores get ``q . R(p) mean`` back, :meth:`Rotary.score_bias`); matching the
model's angles is what makes it effective.  :meth:`Rotary.of` reads them
from mlx-lm's RoPE modules and returns None for a kind it does not know (the
cache then keeps a constant mean, the ``theta = 0`` case).

Block means.  The GPU kernels cannot afford ``q . R(p) mean`` per token (a
sinusoid per pair), so a cache read by them centres each packed token on
the mean of ``R(p) mean`` over its block of ``MEAN_BLOCK`` packed tokens
(positions ``origin + MEAN_BLOCK b ..``, origin = the sinks): one score
term per (query row, block), :meth:`Rotary.block_bias`, that a kernel adds
to the 32 tokens of a chunk.  On SmolLM2 at 6k tokens and window 0 that
keeps ~80% of the exact turned mean's KL gain over a constant mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

_TABLE_STEP = 4096  # positions: the cos/sin table grows in these steps (at least doubling)
# Packed tokens per block of a block mean.  The kernels index a block as
# token >> 5 (a tc8 chunk is one block; a 16-token tile lies in one).
MEAN_BLOCK = 32
# Rotary pairs a GPU cache turns per layer (its top ones by the energy a
# block mean removes; a constant mean for the rest): the fused step's
# compact table has 2 * MEAN_PAIRS columns (SmolLM2, 3.5 bits, window 0,
# rotation seeds 0-3: KL 0.0253 with 16 of 32 pairs, 0.0246 with all, 0.0449
# with none; 0.0277 vs 0.0257 over 4,096 positions).  The pairs left out turn
# too fast for any per-block term: turning them per token (the CPU form,
# 0.0214) is what a block cannot do.
MEAN_PAIRS = 16
_KNOWN: list["Rotary"] = []  # canonical instances (one per distinct set of angles)
_KNOWN_MAX = 16


@dataclass(frozen=True)
class Rotary:
    """Pair ``j`` of the first ``dims`` features turns by ``position * theta[j]``;
    pairs are ``(2j, 2j+1)`` when ``traditional``, else ``(j, j + dims/2)``."""

    theta: mx.array  # float32 [dims // 2]
    dims: int
    traditional: bool
    # cos | sin of positions 0..n-1 [n, dims], shared by every reader of this
    # Rotary (canonical() gives layers with equal angles one instance)
    _table: list = field(default_factory=list, compare=False, repr=False)
    # origin -> block-averaged cos | sin [blocks, dims] (block_table)
    _blocks: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, rope: Any) -> Optional["Rotary"]:
        """The angles of ``rope`` (``nn.RoPE`` or mlx-lm's ``Llama3RoPE``), else None."""
        if type(rope) is nn.RoPE:
            dims, scale = rope.dims, float(rope.scale)
            theta = scale * rope.base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
            return cls(theta.astype(mx.float32), dims, bool(rope.traditional))
        if type(rope).__name__ == "Llama3RoPE" and hasattr(rope, "_freqs"):
            return cls((1.0 / rope._freqs).astype(mx.float32), rope.dims, bool(rope.traditional))
        return None

    def same_angles(self, other: "Rotary") -> bool:
        return (self.dims, self.traditional) == (other.dims, other.traditional) and bool(
            mx.array_equal(self.theta, other.theta))

    def canonical(self) -> "Rotary":
        """The process's one instance with these angles (so all of a model's
        layers, and caches loaded later, share one angle table)."""
        for known in _KNOWN:
            if known.same_angles(self):
                return known
        if len(_KNOWN) >= _KNOWN_MAX:
            _KNOWN.pop(0)
        _KNOWN.append(self)
        return self

    def angles(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """``(cos, sin)`` [T, dims/2] at ``positions`` [T]."""
        a = positions.astype(mx.float32)[:, None] * self.theta[None]
        return mx.cos(a), mx.sin(a)

    def _halves(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The pairs' first and second members and the unturned rest of ``x`` [..., D]."""
        d = self.dims
        head, rest = x[..., :d], x[..., d:]
        if self.traditional:
            return head[..., 0::2], head[..., 1::2], rest
        return head[..., : d // 2], head[..., d // 2:], rest

    def rotate(self, x: mx.array, positions: mx.array) -> mx.array:
        """``x`` [..., T, D] turned to ``positions`` [T] (negative positions undo it)."""
        c, s = self.angles(positions)
        x1, x2, rest = self._halves(x)
        if self.traditional:
            turned = mx.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(*x1.shape[:-1], self.dims)
        else:
            turned = mx.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
        return turned if rest.shape[-1] == 0 else mx.concatenate([turned, rest], axis=-1)

    def table(self, stop: int) -> mx.array:
        """cos | sin [>= stop, dims] of positions 0, 1, ...: computed once and
        grown as contexts grow, so a decode step reads angles, not sines."""
        held = self._table[0] if self._table else None
        if held is None or held.shape[0] < stop:
            n = max(stop, 2 * (0 if held is None else held.shape[0]))
            n = -(-n // _TABLE_STEP) * _TABLE_STEP
            c, s = self.angles(mx.arange(n))
            held = mx.concatenate([c, s], axis=-1)
            mx.eval(held)
            self._table[:] = [held]
        return held

    def block_table(self, origin: int, blocks: int, pairs: Optional[tuple] = None) -> mx.array:
        """cos | sin [>= blocks, dims] averaged over each block of
        ``MEAN_BLOCK`` positions from ``origin``: per pair, the mean of
        ``e^(i p theta)`` over a block is ``e^(i c theta)`` (c its centre)
        times the Dirichlet factor ``sin(B theta / 2) / (B sin(theta / 2))``
        -- no per-position table.  ``pairs``: those pairs' columns only
        (cos of each, then sin of each; the fused step's compact table)."""
        key = origin if pairs is None else (origin, pairs)
        held = self._blocks.get(key)
        if held is None or held.shape[0] < blocks:
            n = max(blocks, 2 * (0 if held is None else held.shape[0]))
            n = -(-n // (_TABLE_STEP // MEAN_BLOCK)) * (_TABLE_STEP // MEAN_BLOCK)
            B = MEAN_BLOCK
            theta = self.theta if pairs is None else self.theta[mx.array(pairs)]
            half = 0.5 * theta
            sin_half = mx.sin(half)
            small = mx.abs(sin_half) < 1e-12
            factor = mx.where(small, 1.0, mx.sin(B * half) / (B * mx.where(small, 1.0, sin_half)))
            centre = origin + B * mx.arange(n).astype(mx.float32) + 0.5 * (B - 1)
            a = centre[:, None] * theta[None]
            held = mx.concatenate([mx.cos(a) * factor, mx.sin(a) * factor], axis=-1)
            mx.eval(held)
            if len(self._blocks) > 128:  # a compact table per layer (pairs), a few origins
                self._blocks.clear()
            self._blocks[key] = held
        return held

    def rows(self, start: int, stop: int, origin: Optional[int] = None) -> mx.array:
        """cos | sin [stop - start, dims] of positions ``start..stop-1``: the
        exact angles, or (``origin`` given) their block averages."""
        if origin is None:
            return self.table(stop)[start:stop]
        first, last = (start - origin) // MEAN_BLOCK, (stop - 1 - origin) // MEAN_BLOCK
        tab = self.block_table(origin, last + 1)
        return tab[(mx.arange(start, stop) - origin) // MEAN_BLOCK] if last > first else \
            mx.broadcast_to(tab[first:first + 1], (stop - start, self.dims))

    def turned(self, mean: mx.array, start: int, stop: int, origin: Optional[int] = None) -> mx.array:
        """``R(p) mean`` [..., stop - start, D] for positions ``start..stop-1``
        (mean [..., 1, D]), from the angle table; with ``origin``, its
        average over each position's block."""
        return self.turn(mean, self.rows(start, stop, origin))

    def turn(self, mean: mx.array, rows: mx.array) -> mx.array:
        """``mean`` [..., 1, D] turned by each of ``rows`` (cos | sin [T, dims],
        e.g. ``block_table``): [..., T, D]."""
        tab = rows
        h = self.dims // 2
        c, s = tab[:, :h], tab[:, h:]
        m1, m2, rest = self._halves(mean.astype(mx.float32))
        a, b = m1 * c - m2 * s, m1 * s + m2 * c
        if self.traditional:
            head = mx.stack([a, b], axis=-1).reshape(*a.shape[:-1], self.dims)
        else:
            head = mx.concatenate([a, b], axis=-1)
        if rest.shape[-1] == 0:
            return head
        return mx.concatenate([head, mx.broadcast_to(rest, (*head.shape[:-1], rest.shape[-1]))], axis=-1)

    def _coef(self, q: mx.array, mean: mx.array) -> tuple[mx.array, Optional[mx.array]]:
        """Per-row coefficients of cos | sin [..., M, dims] and the unturned
        rest's constant [..., M, 1] (None without a rest)."""
        q1, q2, q_rest = self._halves(q)
        m1, m2, m_rest = self._halves(mean.astype(mx.float32))
        coef = mx.concatenate([q1 * m1 + q2 * m2, q2 * m1 - q1 * m2], axis=-1)
        rest = (q_rest * m_rest).sum(axis=-1, keepdims=True) if q_rest.shape[-1] else None
        return coef, rest

    def score_bias(self, q: mx.array, mean: mx.array, start: int, stop: int,
                   origin: Optional[int] = None) -> mx.array:
        """``q . R(p) mean`` [..., M, stop - start] for positions ``start..stop-1``
        (with ``origin``: q . its block average).

        q [..., M, D] (float32), mean [..., 1, D] (pre-RoPE).  Per pair,
        ``q . R(p) m = cos(p theta)(q1 m1 + q2 m2) + sin(p theta)(q2 m1 - q1 m2)``:
        one matmul of per-row coefficients against the cached angle table
        (the unturned rest adds a constant).
        """
        coef, rest = self._coef(q, mean)
        bias = coef @ self.rows(start, stop, origin).T
        return bias if rest is None else bias + rest

    def block_bias(self, q: mx.array, mean: mx.array, origin: int, blocks: int) -> mx.array:
        """``q . (block average of R(p) mean)`` [..., blocks, M] (block-major,
        as the kernels read it) for the first ``blocks`` blocks from
        ``origin``: the score term a kernel adds to every token of a block."""
        coef, rest = self._coef(q, mean)
        bias = self.block_table(origin, blocks)[:blocks] @ coef.swapaxes(-1, -2)
        return bias if rest is None else bias + rest.swapaxes(-1, -2)
