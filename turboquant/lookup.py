"""Index -> value maps as binary trees of selects (the CPU decode's lookup).

MLX's CPU gather (``mx.take``) costs ~15 ns per element; selecting by the
index bits (``b`` levels of ``where`` over constant leaves) fuses into one
elementwise kernel under ``mx.compile`` and is 5-10x faster, which is most
of the decode time.  Both the scalar codebooks and the trellis union
codebooks decode through here (``decode``).  MLX's CPU
fusion handles up to 16 leaves in one kernel; 32 leaves split the graph
(measured 200 ms vs 12 ms for 4M codes), so callers keep trees at 16.
"""

from __future__ import annotations

import mlx.core as mx


def select_tree(code: mx.array, leaves, n_bits: int) -> mx.array:
    """``leaves[code]`` (float32) for an unsigned integer ``code`` < 2**n_bits."""
    vals = [mx.array(c, mx.float32) for c in leaves]
    for k in range(n_bits):
        bit = ((code >> k) & 1).astype(mx.bool_)
        vals = [mx.where(bit, vals[2 * j + 1], vals[2 * j]) for j in range(len(vals) // 2)]
    return vals[0]
