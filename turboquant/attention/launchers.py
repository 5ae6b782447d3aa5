"""Kernel launches: each takes its route and launch shape and decides nothing.

``decode`` runs the split-K kernel of a route (SIMT, TC, TC8) over packed
tokens; ``dequantize`` and ``quantize`` the two kernels around it.  The
route comes from ``route.choose`` (or from the caller: tests and
benchmarks run a kernel directly); the launch shape from ``table``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import mlx.core as mx

from ..codec import SCALE_SEARCH
from ..rotary import MEAN_BLOCK

LOG2E = 1.4426950408889634
from . import device, table
from .pair_tables import codebook_arrays, f32, kernel_tables
from .params import meta, split_params, tc8_head
from .route import Route
from .sources import launch, launch_bounds


def decode(
    q_rot: mx.array, keys_packed: mx.array, keys_norms: mx.array,
    values_packed: mx.array, values_norms: mx.array,
    key_centroids: mx.array, value_centroids: mx.array,
    n: int, key_bits: int, value_bits: int, route: Route,
    blocks: Optional[int] = None, warps: Optional[int] = None,
    key_bias: Optional[mx.array] = None,
) -> tuple[mx.array, mx.array]:
    """Attention of ``q_rot`` [B, H_kv, R, D] over packed tokens ``[0, n)`` by ``route``.

    ``q_rot`` is rotated and already multiplied by ``scale`` (the kernels
    fold in log2(e)).  The packed arrays are the cache's full
    ``[B, H_kv, capacity, words]`` storage (a slice would be copied).
    Returns the normalised rotated-domain output [B, H_kv, R, D] and the
    natural-log log-sum-exp [B, H_kv, R], both float32.  The tensor-core
    routes use fp16 operands with fp32 accumulation (~1e-3 relative error,
    like fp16 SDPA); SIMT is fp32 throughout.  ``blocks``/``warps``: another
    launch shape than the table's (tests, benchmarks).  ``key_bias``: the
    score term of a cache centred on a block mean (``key_bias_layout``).
    """
    B, H, R, D = q_rot.shape
    if values_packed.shape[-1] != (D * value_bits + 31) // 32:
        raise ValueError("decode kernel: values must have the keys' head dim")
    cap = keys_packed.shape[2]
    inputs = [f32(q_rot), keys_packed, keys_norms, values_packed, values_norms]
    kb = int(key_bias is not None)
    bias = [f32(key_bias) if kb else _no_bias()]
    if route is Route.TC8:
        kw = {} if blocks is None else {"blocks": blocks}
        cfg = table.tc8_config(D, R, B * H, n, key_bits, value_bits, warps=warps, **kw)
        tables = kernel_tables(key_centroids, key_bits, value_centroids, value_bits)
        (ws,) = launch(
            "tq_decode_tc8", prelude=cfg["PRELUDE"],
            inputs=inputs + tables + [meta(*tc8_head(n, cap, cfg, H, R, fused=False))] + bias,
            template=list(cfg["TEMPLATE"]) + [("KB", kb)], grid=(cfg["GRID_X"], H, B), threadgroup=(cfg["NW"] * 32, 1, 1),
            output_shapes=[(cfg["WS"],)], output_dtypes=[mx.float32],
            init_value=0.0,  # the split counters start at zero
        )
        o0, l0 = cfg["OFF_OUT"], cfg["OFF_LSE"]
        return ws[o0:o0 + B * H * R * D].reshape(B, H, R, D), ws[l0:l0 + B * H * R].reshape(B, H, R)
    if route is Route.TC:
        cfg = table.tc_config(D, R, B * H, n, blocks=blocks, warps=warps or table.TC_WARPS)
        S, NW = cfg["S"], cfg["NW"]
        params = split_params(n, cap, cfg["TOKS"], H, S, R, cfg["RT"])
        tables = kernel_tables(key_centroids, key_bits, value_centroids, value_bits)
        po, pm, pl = launch(
            "tq_decode_tc", prelude=launch_bounds(NW * 32, 0), inputs=inputs + tables + [params] + bias,
            template=[("D", D), ("BK", key_bits), ("BV", value_bits), ("GL", cfg["GL"]), ("NW", NW),
                      ("KB", kb)],
            grid=(S * NW * 32, H * cfg["RT"], B), threadgroup=(NW * 32, 1, 1),
            output_shapes=[(B, H, S, R, D), (B, H, S, R), (B, H, S, R)],
            output_dtypes=[mx.float32] * 3,
        )
    elif route is Route.SIMT:
        cfg = table.simt_config(D, R, B * H, n, **({} if blocks is None else {"blocks": blocks}))
        if cfg is None:
            raise ValueError(f"decode kernel: unsupported head dim {D} with {R} query rows")
        S, NW = cfg["S"], cfg["NW"]
        params = split_params(n, cap, cfg["TOKS"], H, S, R)
        po, pm, pl = launch(
            "tq_decode", inputs=inputs + [f32(key_centroids), f32(value_centroids), params] + bias,
            template=[("D", D), ("BK", key_bits), ("BV", value_bits), ("GL", R),
                      ("DPT", cfg["DPT"]), ("NW", NW), ("U", cfg["U"]), ("KB", kb)],
            grid=(S * NW * 32, H, B), threadgroup=(NW * 32, 1, 1),
            output_shapes=[(B, H, S, R, D), (B, H, S, R), (B, H, S, R)],
            output_dtypes=[mx.float32] * 3,
        )
    else:
        raise ValueError(f"decode: {route} is not a split-K kernel route")
    out, lse = launch(
        "tq_decode_reduce", inputs=[po, pm, pl, params], template=[("D", D)],
        grid=(D, R, B * H), threadgroup=(D, 1, 1),
        output_shapes=[(B, H, R, D), (B, H, R)], output_dtypes=[mx.float32] * 2,
    )
    return out, lse


def dequantize(
    packed: mx.array, norms: mx.array, centroids: mx.array, n: int, bits: int,
    dim: int, dtype: mx.Dtype = mx.float16, mean_rot: Optional[mx.array] = None,
) -> mx.array:
    """Rotated-domain vectors [B, H, n, dim] of packed tokens ``[0, n)``:
    ``norm * centroids[idx] (+ mean_rot)`` in ``dtype``; ``mean_rot``
    (rotated) is added if given: [B, H, dim] one mean per head, or
    [B, H, ceil(n / 32), dim] one per block of 32 tokens (a block mean)."""
    B, H = packed.shape[:2]
    if mean_rot is None:
        mean_rot = mx.zeros((B, H, dim), mx.float32)
    mean_rows = 1 if mean_rot.ndim == 3 else mean_rot.shape[2]
    (out,) = launch(
        "tq_dequant",
        inputs=[packed, norms, f32(centroids), f32(mean_rot).reshape(B, H, mean_rows, dim),
                split_params(n, packed.shape[2], rows=mean_rows)],
        template=[("D", dim), ("BITS", bits), ("T", dtype)],
        grid=(n * dim, H, B), threadgroup=(256, 1, 1),
        output_shapes=[(B, H, n, dim)], output_dtypes=[dtype],
    )
    return out


@lru_cache(maxsize=1)
def _no_bias() -> mx.array:
    """The key-bias input of a launch without one (KB = 0: never read)."""
    return mx.zeros((1,), mx.float32)


def key_bias(cache, q: mx.array, n: int, scale: float = 1.0) -> mx.array:
    """The key bias of a cache centred on a block mean, as tq_decode_tc8,
    tq_decode_tc and tq_decode read it (``tq_common.h``; the fused step
    computes its own): ``scale * q . mu_b`` for packed tokens ``[0, n)``, q
    [B, H, R, D] unrotated (any float dtype), as [B*H, blocks, RP] in log2
    units; RP = R rounded up to 8, the pad rows zero.  One kernel where the
    kernels run, else the same in MLX ops (``key_bias_ops``)."""
    B, H, R, D = q.shape
    rot = cache.rotary
    if not (device.use_kernels() and rot.dims % 8 == 0):
        return key_bias_ops(cache, q, n, scale)
    rp, nb = -(-R // 8) * 8, -(-n // MEAN_BLOCK)
    (kb,) = launch(
        "tq_key_bias",
        inputs=[q, f32(cache.key_mean_pre), rot.block_table(cache.sink_len, nb), _factor(scale * LOG2E),
                split_params(n, 0, hkv=B * H, rows=R)],
        template=[("D", D), ("DIMS", rot.dims), ("TRAD", int(rot.traditional))],
        grid=(-(-nb // 32) * 256, -(-(B * H * rp) // 32), 1), threadgroup=(256, 1, 1),
        output_shapes=[(B * H, nb, rp)], output_dtypes=[mx.float32],
    )
    return kb


def key_bias_ops(cache, q: mx.array, n: int, scale: float = 1.0) -> mx.array:
    """``key_bias`` in MLX ops (the reference the kernel is tested against)."""
    B, H, R, _ = q.shape
    rp = -(-R // 8) * 8
    q = q.astype(mx.float32) * (scale * LOG2E)
    if rp != R:
        q = mx.pad(q, [(0, 0), (0, 0), (0, rp - R), (0, 0)])
    return cache.key_block_bias(q, n).reshape(B * H, -(-n // MEAN_BLOCK), rp)


@lru_cache(maxsize=64)
def _factor(x: float) -> mx.array:
    """A float32 scalar kernel input (one array per value, not one per launch)."""
    return mx.array([x], mx.float32)


def supports_quantize(codec) -> bool:
    """The quantize kernel: scalar codes, a Hadamard rotation, a power-of-two
    head dim 32..1024."""
    d = codec.dim
    return (
        getattr(codec, "quantizer", "scalar") == "scalar"  # no trellis (TCQ) kernel
        and codec.rotation.uses_hadamard and 32 <= d <= 1024 and (d & (d - 1)) == 0
    )


@lru_cache(maxsize=1)
def _scale_search() -> mx.array:
    """The codec's per-vector input scales, float32 (one array for every launch)."""
    return mx.array(SCALE_SEARCH, mx.float32)


def quantize(x: mx.array, codec) -> tuple[mx.array, mx.array]:
    """``codec.quantize(x)`` in one kernel: (packed uint32 [..., words], norms float16 [...]).

    Matches the reference codec except where float rounding of the rotation
    moves a coordinate across a codebook boundary.
    """
    if not supports_quantize(codec):
        raise ValueError(f"quantize kernel: needs a power-of-two Hadamard dim 32..1024; got {codec.rotation!r}")
    d = codec.dim
    lead = x.shape[:-1]
    m = math.prod(lead)
    bounds, cents = codebook_arrays(codec.bits, d)
    packed, norms = launch(
        "tq_quantize",
        inputs=[x.reshape(m, d), f32(codec.rotation.signs), bounds, cents, _scale_search()],
        template=[("D", d), ("BITS", codec.bits), ("NA", len(SCALE_SEARCH)),
                  ("UNBIASED", int(codec.unbiased)), ("T", x.dtype)],
        grid=(m * d, 1, 1), threadgroup=(d, 1, 1),
        output_shapes=[(m, codec.words), (m,)], output_dtypes=[mx.uint32, mx.float16],
    )
    return packed.reshape(*lead, codec.words), norms.reshape(lead)


def quantize_any(x: mx.array, codec) -> tuple[mx.array, mx.array]:
    """The cache's append hook: the kernel where the kernels run and cover
    the codec, else ``codec.quantize`` (the reference)."""
    if device.use_kernels() and supports_quantize(codec):
        return quantize(x, codec)
    return tuple(codec.quantize(x))
