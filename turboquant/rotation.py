"""Seeded randomized Hadamard rotation of head vectors.

TurboQuant's scalar codebooks assume every coordinate of a unit vector has
the same (Beta) distribution.  Real keys do not: a few channels carry most of
the energy.  Flipping random signs and then applying an orthonormal Hadamard
transform spreads every channel over all coordinates, so after rotation the
coordinates look like those of a uniformly random direction, and the norm and
all inner products are unchanged (orthonormal), so attention can run in the
rotated domain.

``mx.hadamard_transform`` handles ``d = m * 2^k`` with ``m`` in {1, 12, 20, 28}
(so 64, 80 = 20*4, 96 = 12*8, 128, 256).  Its 20- and 28-based matrices are
NOT symmetric (checked: d=80, 112, 160), so the inverse uses the transpose of
the explicit matrix there, while the symmetric (power-of-two, 12-based) cases
reuse the fast transform.  Any other ``d`` falls back to a seeded random
orthogonal matrix (QR of a Gaussian, signs fixed so it is unique) -- the
dense product costs ``d^2`` per vector instead of ``d log d`` but is equally
good at spreading channels.  (MLX aborts the process on unsupported sizes
instead of raising, so the check here must come first.)

Signs come from splitmix64 of the seed, written out in numpy, so the same
seed gives the same rotation on every platform and library version; the
cache stores only ``(dim, seed)``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_HADAMARD_BASES = (1, 12, 20, 28)
_MASK64 = (1 << 64) - 1


def hadamard_supported(dim: int) -> bool:
    """True if ``mx.hadamard_transform`` can do size ``dim`` (m * 2^k, m in 1,12,20,28)."""
    for m in _HADAMARD_BASES:
        if dim % m == 0:
            q = dim // m
            if q >= 1 and q & (q - 1) == 0:
                return True
    return False


def _splitmix64(seed: int, n: int) -> np.ndarray:
    """n pseudo-random uint64 values; a fixed, portable generator."""
    out = np.empty(n, dtype=np.uint64)
    state = seed & _MASK64
    for i in range(n):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out[i] = z ^ (z >> 31)
    return out


def layer_seed(base_seed: int, layer: int) -> int:
    """Seed for one layer: distinct per layer, deterministic from the base seed."""
    return int(_splitmix64(base_seed * 1_000_003 + layer, 1)[0] >> np.uint64(1))


class HadamardRotation:
    """Orthonormal rotation ``y = (x * signs) @ H`` on the last axis.

    ``forward``/``inverse`` accept any leading shape, compute in float32 and
    return the input's dtype.  ``matrix`` is the float32 [dim, dim] matrix
    ``R`` with ``forward(x) == x @ R`` (for kernels that want one matmul).
    """

    def __init__(self, dim: int, seed: int = 0):
        if dim < 1:
            raise ValueError(f"HadamardRotation: dim must be positive, got {dim}")
        self.dim = int(dim)
        self.seed = int(seed)
        bits = _splitmix64(self.seed, self.dim) >> np.uint64(63)
        self.signs = mx.array(np.where(bits == 1, -1.0, 1.0).astype(np.float32))
        self.uses_hadamard = hadamard_supported(self.dim)
        if self.uses_hadamard:
            h = mx.hadamard_transform(mx.eye(self.dim, dtype=mx.float32))
            self.matrix = self.signs[:, None] * h
            self._symmetric = bool(mx.allclose(h, h.T, atol=1e-6).item())
        else:
            rng = np.random.Generator(np.random.PCG64(self.seed))
            q, r = np.linalg.qr(rng.standard_normal((self.dim, self.dim)))
            q = q * np.sign(np.diag(r))[None, :]
            self.matrix = mx.array(q.astype(np.float32))
            self._symmetric = False
        self._matrix_t = self.matrix.T

    def __repr__(self) -> str:
        kind = "hadamard" if self.uses_hadamard else "random-orthogonal"
        return f"HadamardRotation(dim={self.dim}, seed={self.seed}, {kind})"

    @property
    def is_walsh_hadamard(self) -> bool:
        """True for power-of-two ``dim``: ``forward`` is signs then the
        natural-order (Sylvester) Walsh-Hadamard transform, and ``inverse``
        the same transform then the signs -- what a kernel can do in place
        with butterflies instead of a matrix."""
        return self.uses_hadamard and self._symmetric and self.dim & (self.dim - 1) == 0

    def _check(self, x: mx.array, what: str) -> None:
        if x.shape[-1] != self.dim:
            raise ValueError(
                f"HadamardRotation.{what}: last axis is {x.shape[-1]}, expected dim={self.dim}"
            )

    def forward(self, x: mx.array) -> mx.array:
        """Rotate: ``(x * signs) @ H`` (== ``x @ matrix``)."""
        self._check(x, "forward")
        xf = x.astype(mx.float32)
        if self.uses_hadamard:
            y = mx.hadamard_transform(xf * self.signs)
        else:
            y = xf @ self.matrix
        return y.astype(x.dtype)

    def inverse(self, y: mx.array) -> mx.array:
        """Undo :meth:`forward`: ``y @ matrix.T``."""
        self._check(y, "inverse")
        yf = y.astype(mx.float32)
        if self._symmetric:
            x = mx.hadamard_transform(yf) * self.signs
        else:
            x = yf @ self._matrix_t
        return x.astype(y.dtype)
