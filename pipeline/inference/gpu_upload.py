"""Host bytes into GPU memory in bulk, for document caches read from disk (CUDA).

MLX's CUDA backend allocates arrays in unified (managed) memory.  Loaded
the plain way (``mx.load`` on a CPU stream), a 32k-token 8B-shape cache
(~1 GB) costs twice over on an H100: the host filling fresh managed pages
(0.17 s), then the GPU migrating them page fault by page fault at ~8 GB/s
(0.12 s).  Two remedies, both through the driver library (``libcuda.so.1``,
present wherever a CUDA MLX runs; no extra package):

* :func:`read_tensors`: the file's tensors straight into arrays already in
  GPU memory.  Worker threads read each tensor in ``CHUNK``-byte pieces
  into page-locked staging buffers, checksum each piece there, and copy it
  to the GPU with asynchronous DMA while the next piece is read: every
  byte crosses host memory once, at the link's bulk rate.
* :func:`to_gpu`: arrays the host has already written, moved with one
  ``cuMemPrefetchAsync`` each instead of page faults (the fallback path).

Calls run in the device's primary context (the one MLX's runtime calls
use), on this module's own streams.  Anything missing or refused (no CUDA
backend, an old driver, memory that is not managed, no page-locked memory)
makes :func:`read_tensors` raise :class:`Unavailable` and :func:`to_gpu`
return False; the caller then takes the plain path: same data, slower.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Optional, Sequence

import mlx.core as mx

log = logging.getLogger(__name__)

MIN_BYTES = 1 << 16  # prefetch: smaller arrays cost more in driver calls than in faults
CHUNK = 8 << 20  # bytes per staging buffer; each reader thread has two (read one, copy the other)
# reader threads (pread, zlib.crc32 and the driver release the GIL); a 32k-token
# 8B-shape entry (0.98 GB, page cache) on a 16-core H100 host: 0.12-0.13 s at
# 16, 0.15-0.19 s at 8, 0.19-0.21 s at 4
THREADS = min(16, os.cpu_count() or 1)

_P = ctypes.c_void_p
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit sync with MLX's streams
_EVENT_DISABLE_TIMING = 2


class Unavailable(Exception):
    """This process cannot upload through the driver (the message says why)."""


class _MemLocation(ctypes.Structure):
    """``CUmemLocation``: where a prefetch moves memory to."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def _signatures(lib: ctypes.CDLL) -> None:
    """Argument types of every entry point used: pointers must not pass as C ints."""
    sig = {
        "cuInit": [ctypes.c_uint],
        "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_P), ctypes.c_int],
        "cuCtxSetCurrent": [_P],
        "cuStreamCreate": [ctypes.POINTER(_P), ctypes.c_uint],
        "cuStreamSynchronize": [_P],
        "cuEventCreate": [ctypes.POINTER(_P), ctypes.c_uint],
        "cuEventRecord": [_P, _P],
        "cuEventSynchronize": [_P],
        "cuMemHostAlloc": [ctypes.POINTER(_P), ctypes.c_size_t, ctypes.c_uint],
        "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, _P, ctypes.c_size_t, _P],
    }
    for name, args in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int


class _Driver:
    """The driver entry points this module calls, bound to one device."""

    def __init__(self, lib: ctypes.CDLL, ordinal: int):
        _signatures(lib)
        self.lib = lib
        ctx, dev = _P(), ctypes.c_int()
        self.check(lib.cuInit(0), "cuInit")
        self.check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        self.device = dev.value
        self.check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
        self.ctx = ctx
        self.bind()
        self.stream = self.new_stream()
        v2 = getattr(lib, "cuMemPrefetchAsync_v2", None)  # CUDA >= 12.2 drivers
        if v2 is not None:
            v2.argtypes, v2.restype = [ctypes.c_uint64, ctypes.c_size_t, _MemLocation, ctypes.c_uint, _P], ctypes.c_int
            where = _MemLocation(_LOCATION_DEVICE, self.device)
            self._prefetch = lambda ptr, n: v2(ptr, n, where, 0, self.stream)
        else:
            v1 = lib.cuMemPrefetchAsync
            v1.argtypes, v1.restype = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, _P], ctypes.c_int
            self._prefetch = lambda ptr, n: v1(ptr, n, self.device, self.stream)
        self._slots: Optional[queue.Queue] = None
        self._slots_lock = threading.Lock()

    @staticmethod
    def check(code: int, what: str) -> None:
        if code != 0:
            raise Unavailable(f"{what} returned CUresult {code}")

    def bind(self) -> None:
        """Make the primary context current on the calling thread (a
        per-thread setting: readers and the loading thread are any threads)."""
        self.check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def new_stream(self) -> _P:
        s = _P()
        self.check(self.lib.cuStreamCreate(ctypes.byref(s), _STREAM_NON_BLOCKING), "cuStreamCreate")
        return s

    def prefetch(self, spans: Sequence[tuple[int, int]]) -> None:
        """Queue every ``(address, bytes)`` span, then wait for all of them."""
        self.bind()
        for ptr, n in spans:
            self.check(self._prefetch(ptr, n), "cuMemPrefetchAsync")
        self.check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def slots(self) -> queue.Queue:
        """``THREADS`` reader slots (a stream, two page-locked ``CHUNK`` buffers
        and their copy events each), made at the first read and kept for
        the process: pinning costs ~10 ms per 100 MB, once."""
        with self._slots_lock:
            if self._slots is None:
                self.bind()
                q: queue.Queue = queue.Queue()
                for _ in range(THREADS):
                    q.put(_Slot(self))
                self._slots = q
        return self._slots


class _Slot:
    """One reader's stream, staging buffers and the events that say a
    buffer's copy has finished (so it may be refilled)."""

    def __init__(self, drv: _Driver):
        self.stream = drv.new_stream()
        self.buffers, self.views, self.events = [], [], []
        for _ in range(2):
            p = _P()
            drv.check(drv.lib.cuMemHostAlloc(ctypes.byref(p), CHUNK, 0), "cuMemHostAlloc")
            self.buffers.append(p)
            self.views.append(memoryview((ctypes.c_char * CHUNK).from_address(p.value)).cast("B"))
            e = _P()
            drv.check(drv.lib.cuEventCreate(ctypes.byref(e), _EVENT_DISABLE_TIMING), "cuEventCreate")
            self.events.append(e)


@lru_cache(maxsize=1)
def _driver() -> Optional[_Driver]:
    """The bound driver, or None where this process cannot use it."""
    from turboquant.attention import device

    if device.backend() != "cuda" or not device.on_gpu():
        return None
    try:
        # device 0: MLX's CUDA default, and each Ray worker's one visible GPU
        return _Driver(ctypes.CDLL("libcuda.so.1"), 0)
    except (OSError, AttributeError, Unavailable) as e:
        log.info("GPU uploads unavailable (%s); loaded caches take the plain path", e)
        return None


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _DLTensor(ctypes.Structure):
    """The head of DLPack's ``DLTensor``: where an array's bytes are."""

    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("dtype", ctypes.c_uint32), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def address(a: mx.array, *, require_contiguous: bool = False) -> int:
    """Where an evaluated array's first byte lives (through DLPack, which
    every MLX dtype supports).  ``require_contiguous``: raise ValueError
    unless the array's elements are its own row-major bytes (the only kind
    an upload may write ``a.nbytes`` into)."""
    capsule = a.__dlpack__()
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    if require_contiguous and t.strides:
        expect = 1
        for i in range(t.ndim - 1, -1, -1):
            if t.shape[i] != 1 and t.strides[i] != expect:
                raise ValueError("array is not row-contiguous")
            expect *= t.shape[i]
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
    except Unavailable as e:
        log.info("GPU prefetch refused (%s); loaded caches move to the GPU on first use", e)
        return False
    return True


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of an open file: where its bytes are and what they become."""

    name: str
    offset: int  # in the file
    length: int  # bytes
    dtype: mx.Dtype
    shape: tuple[int, ...]


def available() -> bool:
    """Whether :func:`read_tensors` can run in this process."""
    return _driver() is not None


def prepare() -> bool:
    """Make the driver's reader slots now (streams and page-locked staging
    buffers, ``THREADS`` x 2 x ``CHUNK``) and bind the driver, so that the
    first document loaded from the store does not pay them (an engine's
    warm-up calls this).  On an H100, a 32k-token entry's load in a fresh
    process took 0.24-0.26 s; ``read_tensors`` alone takes 0.15-0.19 s once
    its slots exist.  True where :func:`read_tensors` can run."""
    drv = _driver()
    if drv is None:
        return False
    try:
        drv.slots()
    except Unavailable as e:
        log.info("GPU upload slots refused (%s)", e)
        return False
    return True


def read_tensors(fd: int, spans: Sequence[TensorSpan]) -> tuple[dict[str, mx.array], dict[str, int]]:
    """Every span of the open file ``fd`` as an array in GPU memory, and the
    CRC-32 of each tensor's bytes as read (for the caller to compare).

    The arrays are made (zeroed) by MLX on the GPU and evaluated first, so
    they are resident, row-contiguous and nobody else's; the copies into
    them are finished before this returns.  Raises :class:`Unavailable`
    where the driver refuses (nothing is returned half-written), OSError
    for a file that cannot be read, EOFError for one cut short.
    """
    drv = _driver()
    if drv is None:
        raise Unavailable("no CUDA driver in this process")
    arrays = {s.name: mx.zeros(s.shape, s.dtype) for s in spans}
    mx.eval(list(arrays.values()))
    targets = []
    for s in spans:
        a = arrays[s.name]
        if a.nbytes != s.length:
            raise ValueError(f"tensor {s.name!r}: {s.length} bytes for {a.nbytes} in {s.shape} {s.dtype}")
        targets.append((s, address(a, require_contiguous=True) if s.length else 0))
    slots = drv.slots()

    def one(span: TensorSpan, dst: int) -> int:
        slot = slots.get()
        try:
            drv.bind()
            return _copy_tensor(drv, slot, fd, span, dst)
        finally:
            slots.put(slot)

    targets.sort(key=lambda t: -t[0].length)  # the longest first: the threads finish together
    crcs, errors = {}, []
    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(one, s, dst) for s, dst in targets]
        for f, (s, _) in zip(futures, targets):
            try:
                crcs[s.name] = f.result()
            except Exception as e:  # every reader finishes before any error is raised
                errors.append(e)
    if errors:
        raise errors[0]
    return arrays, crcs


def _copy_tensor(drv: _Driver, slot: _Slot, fd: int, span: TensorSpan, dst: int) -> int:
    """One tensor through ``slot``'s two staging buffers; returns its CRC-32.

    Piece k is read into buffer k % 2 once that buffer's previous copy has
    finished (its event), checksummed there, and its copy queued: reading
    piece k + 1 overlaps the DMA of piece k."""
    lib = drv.lib
    crc, done, k = 0, 0, 0
    try:
        while done < span.length:
            b = k & 1
            if k >= 2:
                drv.check(lib.cuEventSynchronize(slot.events[b]), "cuEventSynchronize")
            want = min(CHUNK, span.length - done)
            view = slot.views[b][:want]
            got = 0
            while got < want:
                n = os.preadv(fd, [view[got:]], span.offset + done + got)
                if not n:
                    raise EOFError(f"tensor {span.name!r} is cut short")
                got += n
            crc = zlib.crc32(view, crc)
            drv.check(lib.cuMemcpyHtoDAsync_v2(dst + done, slot.buffers[b], want, slot.stream), "cuMemcpyHtoDAsync")
            drv.check(lib.cuEventRecord(slot.events[b], slot.stream), "cuEventRecord")
            done += want
            k += 1
    except BaseException:
        lib.cuStreamSynchronize(slot.stream)  # the buffers go back to the pool only once no copy reads them
        raise
    drv.check(lib.cuStreamSynchronize(slot.stream), "cuStreamSynchronize")
    return crc
