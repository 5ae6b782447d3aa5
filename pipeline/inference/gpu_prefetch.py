"""Move arrays the host has just written into GPU memory in bulk (CUDA).

MLX's CUDA backend allocates arrays in unified (managed) memory.  A loaded
document cache is written by the host (``mx.load`` on the CPU stream), so
its pages live in host memory until a kernel reads them; the GPU then
migrates them page fault by page fault, ~8 GB/s on an H100 (0.12 s for a
32k-token 8B-shape cache, a quarter of that load's time to first token).
One ``cuMemPrefetchAsync`` per array moves the same bytes as bulk copies.

Only the driver library is needed (``libcuda.so.1``, present wherever a
CUDA MLX runs); the calls run on this module's own stream in the device's
primary context, the one MLX's runtime calls use.  Anything missing or
refused (no CUDA backend, an old driver, memory that is not managed) makes
:func:`to_gpu` return False and leaves the migration to the page faults:
the data and results are the same either way, only slower.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from typing import Iterable, Optional

import mlx.core as mx

log = logging.getLogger(__name__)

MIN_BYTES = 1 << 16  # smaller arrays: a driver call costs more than their faults


class _MemLocation(ctypes.Structure):
    """``CUmemLocation``: where a prefetch moves memory to."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit sync with MLX's streams


class _Driver:
    """The driver entry points this module calls, bound to one device."""

    def __init__(self, lib: ctypes.CDLL, ordinal: int):
        self.lib = lib
        ctx, dev, stream = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_void_p()
        self._check(lib.cuInit(0), "cuInit")
        self._check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        self.device = dev.value
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.ctx = ctx
        self._bind()
        self._check(lib.cuStreamCreate(ctypes.byref(stream), _STREAM_NON_BLOCKING), "cuStreamCreate")
        self.stream = stream
        v2 = getattr(lib, "cuMemPrefetchAsync_v2", None)  # CUDA >= 12.2 drivers
        if v2 is not None:
            v2.argtypes = [ctypes.c_uint64, ctypes.c_size_t, _MemLocation, ctypes.c_uint, ctypes.c_void_p]
            where = _MemLocation(_LOCATION_DEVICE, self.device)
            self._prefetch = lambda ptr, n: v2(ptr, n, where, 0, self.stream)
        else:
            v1 = lib.cuMemPrefetchAsync
            v1.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            self._prefetch = lambda ptr, n: v1(ptr, n, self.device, self.stream)

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise OSError(f"{what} returned CUresult {code}")

    def _bind(self) -> None:
        """Make the primary context current on the calling thread (a
        per-thread setting: the loading thread may be any thread)."""
        self._check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def prefetch(self, spans: list[tuple[int, int]]) -> None:
        """Queue every ``(address, bytes)`` span, then wait for all of them."""
        self._bind()
        for ptr, n in spans:
            self._check(self._prefetch(ptr, n), "cuMemPrefetchAsync")
        self._check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")


@lru_cache(maxsize=1)
def _driver() -> Optional[_Driver]:
    """The bound driver, or None where this process cannot prefetch."""
    from turboquant.attention import device

    if device.backend() != "cuda":
        return None
    try:
        # device 0: MLX's CUDA default, and each Ray worker's one visible GPU
        return _Driver(ctypes.CDLL("libcuda.so.1"), 0)
    except (OSError, AttributeError) as e:
        log.info("GPU prefetch unavailable (%s); loaded caches move to the GPU on first use", e)
        return None


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _DLTensor(ctypes.Structure):
    """The head of DLPack's ``DLTensor``: enough to find an array's bytes."""

    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("dtype", ctypes.c_uint32), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("byte_offset", ctypes.c_uint64)]


def address(a: mx.array) -> int:
    """Where an evaluated array's first byte lives (through DLPack, which
    every MLX dtype supports)."""
    capsule = a.__dlpack__()
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    return int(t.data or 0) + int(t.byte_offset)


def to_gpu(arrays: Iterable[mx.array]) -> bool:
    """Move evaluated ``arrays`` into GPU memory now; True if they were.

    False (nothing moved, nothing changed) without a CUDA backend or where
    the driver refuses; the first kernel to read them moves them then.
    """
    drv = _driver()
    if drv is None:
        return False
    spans = [(address(a), a.nbytes) for a in arrays if a.nbytes >= MIN_BYTES]
    try:
        drv.prefetch(spans)
    except OSError as e:
        log.info("GPU prefetch refused (%s); loaded caches move to the GPU on first use", e)
        return False
    return True
