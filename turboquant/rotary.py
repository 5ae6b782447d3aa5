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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

_TABLE_STEP = 4096  # positions: the cos/sin table grows in these steps (at least doubling)
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

    def turned(self, mean: mx.array, start: int, stop: int) -> mx.array:
        """``R(p) mean`` [..., stop - start, D] for positions ``start..stop-1``
        (mean [..., 1, D]), from the angle table."""
        tab = self.table(stop)[start:stop]
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

    def score_bias(self, q: mx.array, mean: mx.array, start: int, stop: int) -> mx.array:
        """``q . R(p) mean`` [..., M, stop - start] for positions ``start..stop-1``.

        q [..., M, D] (float32), mean [..., 1, D] (pre-RoPE).  Per pair,
        ``q . R(p) m = cos(p theta)(q1 m1 + q2 m2) + sin(p theta)(q2 m1 - q1 m2)``:
        one matmul of per-row coefficients against the cached angle table
        (the unturned rest adds a constant).
        """
        q1, q2, q_rest = self._halves(q)
        m1, m2, m_rest = self._halves(mean.astype(mx.float32))
        coef = mx.concatenate([q1 * m1 + q2 * m2, q2 * m1 - q1 * m2], axis=-1)
        bias = coef @ self.table(stop)[start:stop].T
        if q_rest.shape[-1]:
            bias = bias + (q_rest * m_rest).sum(axis=-1, keepdims=True)
        return bias
