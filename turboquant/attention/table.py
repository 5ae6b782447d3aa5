"""Launch shapes: every tuned number of the kernels, in one table.

Tuned on an H200 (132 SMs); docs/benchmarks.md has the figures.  The
functions turn a table row and a call's sizes into the launch of one
kernel; they choose nothing (``route.choose`` picked the kernel) and read
no settings.  ``blocks`` / ``warps`` arguments exist for tests and
benchmarks that exercise other launch shapes of the same kernel.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from .sources import launch_bounds

# -- routes around the kernels
PREFILL_ROWS = 16  # query rows per kv head above which SIMT decode yields to dequantize + SDPA
# Query rows per kv head from which a CUDA prefill chunk dequantizes the
# history for MLX's fused SDPA instead of running the tc kernel: tc decodes
# the codes again for every 16-row tile, the dequantize pass costs one read
# of the history.  H100, 32/8 heads, d=128, warm shapes: at 1,024 rows
# dequantize + SDPA takes 0.57-0.70x tc's time (32k-256k tokens of history),
# at 8,192 (a 2,048-token chunk) 0.18-0.27x; at 256 rows 1.0-2.2x
# (docs/results/prefill_routes_h100.json).
PREFILL_SDPA_ROWS = 1024
# Largest temporary of dequantize + SDPA: one layer's history in the model
# dtype (keys and values, then joined with the window).  Past it the
# blockwise kernels run (tc on CUDA, the reference path elsewhere), whose
# extra memory is one block.  1.25 GiB: 160k tokens x 8 kv heads x d=128 in
# bf16, keys and values, with the copy.  Bounded this low because a whole
# model's prefill peak grew by more than one layer's temporary: tqpipe run on
# an H200, 8B shape, 131k tokens, 36.6 GB against 23.9 GB through tc (bf16:
# 50.4 GB); longer histories are not measured, so they keep tc.
PREFILL_DEQUANT_BYTES = 5 << 28
WINDOW_SCORES_BYTES = 32 << 20  # float32 scores of one block of window queries

# -- tq_decode (SIMT, every backend)
SIMT_BLOCKS = 264  # threadgroups: 2 waves of the 132 SMs
SIMT_WARPS = 8
SIMT_UNROLL = 4  # tokens per stream per loop step (loads issued first)
SIMT_SMEM_BYTES = 40960  # threadgroup memory for the cross-warp reduction

# -- tq_decode_tc (tensor cores, 16-row tiles: prefill chunks and > 8 rows)
TC_WARPS = 4
TC_BLOCKS = 198  # below TC_LONG_TOKENS: every threadgroup copies up to 40 KB of tables first
TC_BLOCKS_LONG = 396  # one full wave of 3 per SM (~150 registers x 128 threads)
TC_LONG_TOKENS = 1 << 18

# -- tq_decode_tc8 / tq_decode_tc8_fused (tensor cores, <= 8 rows: decode)
TC8_BLOCKS = 264  # threadgroups: 2 resident per SM, one wave
# 8 warps under a 128-register cap (2 resident threadgroups): chained decode
# steps are latency bound, and 16 warps per SM hide more of it.  With 4-bit
# keys and 3-bit values the cap spills 16-24 bytes per thread and is still
# the fastest launch (H100, 128k tokens, 32 dependent steps per token:
# 0.069 ms per step against 0.075 ms for 4 warps uncapped and 0.073 ms for 4
# warps in 396 threadgroups).
TC8_WARPS = 8
TC8_COUNTER_WORDS = 32  # per (batch, kv head): a 128-byte line (CNT_WORDS in tq_decode_tc8.inc)
# Counter sets a step plan uses in turn (the kernel leaves each at zero, so
# no zero-fill node per step); a launch takes the output of the launch
# TC8_COUNTER_RING before it as an ordering input.
TC8_COUNTER_RING = 8


def simt_config(d: int, rows: int, b_hkv: int, n: int, blocks: int = SIMT_BLOCKS) -> Optional[dict]:
    """Launch shape of ``tq_decode``, or None if the shape is not covered.

    ``DPT`` dims per lane keeps ``rows * DPT`` (queries + accumulators in
    registers) near 64; ``D / DPT`` lanes share a token and must divide the
    32-lane warp.  Splits target ``blocks`` threadgroups.
    """
    dpt = max(16 if rows <= 4 else 8 if rows <= 8 else 4, d // 32)
    if d % dpt or (d // dpt) & (d // dpt - 1) or rows * dpt > 128 or d > 256:
        return None
    gpw = 32 // (d // dpt)
    nw = SIMT_WARPS
    while nw > 1 and nw * rows * d * 4 > SIMT_SMEM_BYTES:
        nw //= 2
    step = SIMT_UNROLL * nw * gpw  # tokens one threadgroup covers per loop step
    splits = max(1, -(-blocks // max(1, b_hkv)))
    toks = max(step, -(-n // splits))
    toks = -(-toks // step) * step
    return {"DPT": dpt, "NW": nw, "U": SIMT_UNROLL, "TOKS": toks, "S": -(-n // toks)}


def tc_config(d: int, rows: int, b_hkv: int, n: int, blocks: Optional[int] = None,
              warps: int = TC_WARPS) -> dict:
    """Launch shape of ``tq_decode_tc``: a threadgroup serves one tile of up to
    16 query rows (``GL``) of one kv head; tokens are split so that about
    ``blocks`` threadgroups cover the GPU, at least 4 tiles per warp (the
    table copy amortizes)."""
    gl = min(rows, 16)
    rt = -(-rows // 16)
    nw = min(warps, 4) if gl > 8 else warps  # shared memory of the 16-row reduction
    step = 16 * nw
    target = blocks or (TC_BLOCKS_LONG if n >= TC_LONG_TOKENS else TC_BLOCKS)
    splits = max(1, -(-target // max(1, b_hkv * rt)))
    toks = max(4 * step, -(-n // splits))
    toks = -(-toks // step) * step
    return {"GL": gl, "RT": rt, "NW": nw, "TOKS": toks, "S": -(-n // toks)}


def table_copies(key_bits: int, value_bits: int) -> tuple[int, int]:
    """Copies of the (key, value) pair tables: 32 each (every lane its own
    bank) while both tables fit 40 KB of shared memory, else 16 for a
    256-entry (4-bit) table.  With 4-bit keys and 3-bit values the key table
    in 16 copies cost lanes l and l + 16 a 2-way bank conflict on about half
    the key lookups.  Both tensor-core kernels read them so: must match CK,
    CV in tq_decode_tc8.inc and tq_decode_tc.inc."""
    ek, ev = 1 << (2 * key_bits), 1 << (2 * value_bits)
    all32 = (ek + ev) * 32 * 4 <= 40960
    return (32 if all32 or ek < 256 else 16), (32 if all32 or ev < 256 else 16)


def fused_max_window(d: int, rows: int, warps: Optional[int] = None) -> int:
    """Longest exact window the fused step takes: the window's scores share
    the kernel's reduction area, ``R * (D + W) + 24 <= NW * 8 * (D + 2)`` words."""
    return max(0, ((warps or TC8_WARPS) * 8 * (d + 2) - 24) // rows - d)


def tc8_config(d: int, rows: int, b_hkv: int, n: int, key_bits: int = 3, value_bits: int = 4,
               window: bool = False, blocks: int = TC8_BLOCKS, warps: Optional[int] = None) -> dict:
    """Launch shape of the tc8 kernel and its workspace layout.

    128 registers (``MINB`` = 2 resident threadgroups of 8 warps).  The
    split count sizes the grid; warps draw 32-token chunks of their head
    from a counter.  Every split writes a partial state and the last of its
    (batch, kv head) merges them, so the workspace holds counters (a line
    per head), the output and log-sum-exp, and the partials.  ``window``: the fused step, whose
    extra threadgroup per head attends over the window and writes partial
    slot ``S`` (``SLOTS = S + 1``); its output is an array of its own.
    """
    return _tc8_config(d, rows, b_hkv, n, key_bits, value_bits, bool(window), blocks, warps)


@lru_cache(maxsize=4096)
def _tc8_config(d, rows, b_hkv, n, key_bits, value_bits, window, blocks, warps) -> dict:
    nw = warps or TC8_WARPS
    step = 16 * nw
    # the window's threadgroups count against the target: one wave
    target = blocks - (b_hkv if window else 0)
    splits = max(1, target // max(1, b_hkv))  # rounded down: no straggler wave
    toks = max(2 * step, -(-n // splits))  # >= 2 tiles per warp
    toks = -(-toks // step) * step
    S = -(-n // toks)
    slots = S + int(window)
    off_out = TC8_COUNTER_WORDS * b_hkv
    off_lse = off_out + (0 if window else b_hkv * rows * d)
    off_po = -(-(off_lse + (0 if window else b_hkv * rows)) // 4) * 4
    off_pm = off_po + b_hkv * slots * rows * d
    off_pl = off_pm + b_hkv * slots * rows
    minb = max(1, 16 // nw)
    return {"NW": nw, "TOKS": toks, "S": S, "SLOTS": slots, "MINB": minb,
            "OFF_OUT": off_out, "OFF_LSE": off_lse, "OFF_PO": off_po, "OFF_PM": off_pm,
            "OFF_PL": off_pl, "WS": off_pl + b_hkv * slots * rows,
            # the launch arguments that follow from the above (built once, not per step)
            "TEMPLATE": (("D", d), ("BK", key_bits), ("BV", value_bits), ("NW", nw)),
            "PRELUDE": launch_bounds(nw * 32, minb), "GRID_X": slots * nw * 32}
