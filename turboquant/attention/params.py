"""The kernels' parameter arrays, field by field as ``metal/tq_common.h`` lays them out.

Custom kernels take arrays, not scalars: each launch uploads one small
int32 array, read in the kernel through ``tq_split_params`` or
``tq_tc8_params``.  Field order here and in the structs must agree.
"""

from __future__ import annotations

import struct
from functools import lru_cache

import mlx.core as mx


@lru_cache(maxsize=256)
def meta(*values: int) -> mx.array:
    """An int32 parameter array, cached: building one is a host-to-device copy."""
    return mx.array(values, dtype=mx.int32)


def split_params(n: int, capacity: int, toks: int = 0, hkv: int = 0, splits: int = 0,
                 rows: int = 0, row_tiles: int = 0) -> mx.array:
    """``tq_split_params``: tq_decode, tq_decode_reduce, tq_dequant, tq_decode_tc."""
    return meta(n, capacity, toks, hkv, splits, rows, row_tiles)


def tc8_head(n: int, capacity: int, cfg: dict, hkv: int, rows: int, fused: bool) -> tuple:
    """The first eleven fields of ``tq_tc8_params`` (through ``off_pl``) for
    the layout ``cfg`` (``table.tc8_config``); the fused step has no output
    region in ws (``off_out`` = ``off_lse`` = 0)."""
    splits = cfg["SLOTS"] if fused else cfg["S"]
    off_out, off_lse = (0, 0) if fused else (cfg["OFF_OUT"], cfg["OFF_LSE"])
    return (n, capacity, cfg["TOKS"], hkv, splits, rows, off_out, off_lse,
            cfg["OFF_PO"], cfg["OFF_PM"], cfg["OFF_PL"])


def float_bits(x: float) -> int:
    """The bits of a float32, as the kernel's ``scale_bits`` field holds them."""
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]
