"""The one kernel decision: :func:`choose` maps a call to a :class:`Route`.

Pure: it reads the call's sizes (a :class:`Call`, built by :func:`describe`)
and the process's backend and ``TQ_KERNELS`` mode, and nothing else -- no
environment, no device queries -- so every branch is testable on a CPU.
The launchers run the route they are given.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from . import table


class Route(enum.Enum):
    REFERENCE = "reference"  # pure MLX, blockwise online softmax (any device)
    SIMT = "simt"  # tq_decode + tq_decode_reduce: the shared kernel (Metal, CUDA)
    TC8 = "tc8"  # tensor cores, <= 8 rows, reduction fused (CUDA decode)
    TC = "tc"  # tensor cores, tiles of 16 rows (CUDA prefill chunks)
    FUSED_STEP = "fused_step"  # the whole decode step in one launch (CUDA)
    DEQUANT_SDPA = "dequant_sdpa"  # dequantize the history, then mx.fast SDPA


@dataclass(frozen=True)
class Call:
    """What the choice depends on, for one attention call."""

    batch: int
    q_heads: int
    kv_heads: int
    length: int  # query positions L
    head_dim: int  # D of queries and keys
    window_key_dim: int
    value_dim: int
    window: int  # exact-window tokens W
    packed: int  # packed tokens
    capacity: int  # token capacity of the packed arrays
    key_bits: int
    value_bits: int
    itemsize: int  # bytes per element of the queries' dtype
    codec_dim: int  # the key codec's head dim
    scalar_codes: bool  # both codecs scalar (the kernels decode no trellis codes)
    hadamard: bool  # both rotations Walsh-Hadamard butterflies (the fused step's FWHT)
    packed_mask: bool  # a mask reaches into the packed history
    window_mask: bool  # a mask over the window
    sinks: bool
    on_gpu: bool  # MLX's default device is the GPU
    # keys centred on a pre-RoPE mean turned to each token (turboquant.rotary),
    # not on its per-block average (which every kernel adds back)
    rotary_mean: bool = False

    @property
    def rows(self) -> int:
        """Query rows per kv head (GQA group x positions)."""
        return (self.q_heads // self.kv_heads) * self.length


def describe(queries, window_keys, window_values, cache, packed_mask, window_mask, sinks,
             on_gpu: bool) -> Call:
    """The :class:`Call` of ``turboquant_attention``'s arguments."""
    B, H_q, L, D = queries.shape
    kc, vc = cache.key_codec, cache.value_codec
    rot = cache.rotation
    vrot = getattr(cache, "value_rotation", None) or rot
    return Call(
        batch=B, q_heads=H_q, kv_heads=window_keys.shape[1], length=L, head_dim=D,
        window_key_dim=window_keys.shape[-1], value_dim=window_values.shape[-1],
        window=window_keys.shape[2], packed=cache.packed_len,
        capacity=0 if cache.keys_norms is None else cache.keys_norms.shape[2],
        key_bits=kc.bits, value_bits=vc.bits, itemsize=queries.dtype.size,
        codec_dim=getattr(kc, "dim", D),
        scalar_codes=getattr(kc, "quantizer", "scalar") == "scalar"
        and getattr(vc, "quantizer", "scalar") == "scalar",
        hadamard=bool(getattr(rot, "is_walsh_hadamard", False) and getattr(vrot, "is_walsh_hadamard", False)),
        packed_mask=packed_mask is not None, window_mask=window_mask is not None,
        sinks=sinks is not None, on_gpu=on_gpu,
        rotary_mean=getattr(cache, "key_mean_pre", None) is not None and not getattr(cache, "mean_blocks", False),
    )


def kernels_allowed(backend: Optional[str], mode: str, on_gpu: bool) -> bool:
    """``TQ_KERNELS`` against the device: ``gpu`` without a backend is an error."""
    if mode == "reference":
        return False
    if mode == "gpu":
        if backend is None:
            raise RuntimeError(
                "TQ_KERNELS=gpu, but this MLX build has neither Metal nor CUDA "
                "(install mlx[cuda13] on NVIDIA, or unset TQ_KERNELS)"
            )
        return True
    return backend is not None and on_gpu


def block_mean_wanted(backend: Optional[str], mode: str, on_gpu: bool) -> bool:
    """Whether a cache made now centres keys on the turned pre-RoPE mean's
    per-block average (``turboquant.rotary``) rather than on the exact
    turned mean.

    The kernels add back one score term per (query row, block of 32 packed
    tokens); a per-token term (a sinusoid per rotary pair) would cost them
    more than the scores themselves.  Where the reference path reads the
    cache (no GPU kernels), the exact turned mean costs one matmul per
    block of history and keeps ~20% more of the quality gain.
    """
    return kernels_allowed(backend, mode, on_gpu)


def split_k_route(backend: Optional[str], d: int, capacity: int, rows: int) -> Route:
    """The split-K kernel for a head dim, capacity and row count: the
    tensor-core kernels on CUDA for d 64/128 (tc8 up to 8 rows, tc beyond),
    which load float16 norms in pairs (even capacity: the cache's is a
    multiple of 256); the shared SIMT kernel otherwise."""
    if backend == "cuda" and d in (64, 128) and capacity % 2 == 0:
        return Route.TC8 if rows <= 8 else Route.TC
    return Route.SIMT


def dequant_bytes(c: Call) -> int:
    """Bytes of the dequantized [history; window] keys + values, twice (concat)."""
    return 2 * 2 * c.batch * c.kv_heads * (c.packed + c.window) * c.head_dim * c.itemsize


def choose(c: Call, backend: Optional[str], mode: str) -> Route:
    """The route of one attention call.

    Reference: kernels off (``TQ_KERNELS``, no GPU), attention sinks, no
    packed history, or a shape the kernels do not cover.  On CUDA the
    tensor-core kernels read the packed codes without a mask into the
    history: the fused step for a decode step (<= 8 rows, no window mask,
    Walsh-Hadamard rotations, a window that fits shared memory), tc8 or tc
    otherwise -- except that a prefill chunk of ``PREFILL_SDPA_ROWS`` rows
    or more dequantizes the history for one fused SDPA while the temporary
    fits (tc decodes the codes again for every 16-row tile).  Elsewhere
    (and for a mask into the history) SIMT up to ``PREFILL_ROWS`` rows, then
    dequantize + SDPA while its temporary fits ``PREFILL_DEQUANT_BYTES``, the
    reference path beyond; a cache centred on a mean turned per token (not
    per block) takes those two only.
    """
    if c.sinks or not kernels_allowed(backend, mode, c.on_gpu):
        return Route.REFERENCE
    fits = dequant_bytes(c) <= table.PREFILL_DEQUANT_BYTES
    if c.rotary_mean:  # no kernel adds the per-key q . R(p) mean (block_mean_wanted)
        return Route.DEQUANT_SDPA if fits else Route.REFERENCE
    D = c.head_dim
    supported = (c.packed > 0 and c.window_key_dim == D and D in (64, 128, 256)
                 and c.codec_dim == D and c.scalar_codes)
    if not supported:
        return Route.REFERENCE
    rows = c.rows
    kernel = split_k_route(backend, D, c.capacity, rows)
    if kernel is Route.TC and rows >= table.PREFILL_SDPA_ROWS and fits:
        return Route.DEQUANT_SDPA
    tiled = not c.packed_mask and kernel is not Route.SIMT
    if not tiled and (c.packed_mask or rows > table.PREFILL_ROWS
                      or table.simt_config(D, rows, c.batch * c.kv_heads, 1) is None):
        return Route.DEQUANT_SDPA if fits else Route.REFERENCE
    if (kernel is Route.TC8 and not c.window_mask and c.hadamard and c.value_dim == D
            and 1 <= c.window <= table.fused_max_window(D, rows)):
        return Route.FUSED_STEP
    return kernel
