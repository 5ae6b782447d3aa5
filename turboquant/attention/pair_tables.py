"""Codebook tables the kernels read, built once per codebook on the host."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from .table import table_copies

_PAIR_TABLES: dict = {}


def f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def centroids(codec) -> mx.array:
    """The codec's own centroid array (not a fresh copy per call): pair
    tables are cached per codebook array."""
    return f32(codec.centroids)


@lru_cache(maxsize=None)
def codebook_arrays(bits: int, dim: int) -> tuple[mx.array, mx.array]:
    """(boundaries, centroids) float32 on the device, for the quantize kernel."""
    from ..codebooks import codebook

    cb = codebook(bits, dim)
    return cb.boundaries_mx(), cb.centroids_mx()


def pair_table(centroids: mx.array, bits: int, copies: int) -> mx.array:
    """The tensor-core kernels' codebook pair table: entry ``e = i0 | i1 << bits``
    holds half2(c[i0], c[i1]) (raw uint32 bits), stored ``copies`` times side
    by side so each lane reads its own bank.  Every threadgroup copies it to
    shared memory with 16-byte loads."""
    key = (id(centroids), bits, copies)
    hit = _PAIR_TABLES.get(key)
    if hit is not None and hit[0] is centroids:
        return hit[1]
    import numpy as np

    c = np.asarray(centroids.astype(mx.float32)).astype(np.float16).view(np.uint16).astype(np.uint32)
    e = np.arange(1 << (2 * bits))
    pairs = c[e & ((1 << bits) - 1)] | (c[e >> bits] << 16)
    table = mx.array(np.repeat(pairs, copies).astype(np.uint32))
    if len(_PAIR_TABLES) > 4096:  # up to 32 KB each; one per codec in practice
        _PAIR_TABLES.clear()
    _PAIR_TABLES[key] = (centroids, table)  # holds the array: its id stays unique
    return table


def kernel_tables(key_centroids: mx.array, key_bits: int, value_centroids: mx.array,
                  value_bits: int) -> list:
    """The two pair tables a tensor-core launch reads, in the copies
    ``table.table_copies`` gives (the kernels derive the same counts)."""
    key_copies, value_copies = table_copies(key_bits, value_bits)
    return [pair_table(key_centroids, key_bits, key_copies),
            pair_table(value_centroids, value_bits, value_copies)]
