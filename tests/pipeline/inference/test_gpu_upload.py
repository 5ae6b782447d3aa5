"""gpu_upload: array addresses are exact; the staged reader copies every
byte to its place and checksums what it read; without CUDA nothing moves."""

from __future__ import annotations

import ctypes
import queue
import zlib

import mlx.core as mx
import pytest

from pipeline.inference import gpu_upload


@pytest.mark.parametrize("dtype", [mx.uint32, mx.float16, mx.bfloat16, mx.float32])
def test_address_is_the_first_byte_of_the_array_and_its_slices(dtype):
    a = (mx.arange(4096) * 3 + 1).astype(dtype)
    tail = a[100:]
    mx.eval(a, tail)
    raw = mx.view(a, mx.uint8)
    assert ctypes.string_at(gpu_upload.address(a), 4) == bytes(memoryview(raw)[:4])
    step = a.itemsize * 100
    assert ctypes.string_at(gpu_upload.address(tail), 4) == bytes(memoryview(raw)[step : step + 4])


def test_only_row_contiguous_arrays_are_upload_targets():
    a = mx.zeros((8, 6), dtype=mx.uint32)
    t = a.T
    mx.eval(a, t)
    assert gpu_upload.address(a, require_contiguous=True) == gpu_upload.address(a)
    with pytest.raises(ValueError, match="row-contiguous"):
        gpu_upload.address(t, require_contiguous=True)


def test_nothing_moves_without_a_cuda_backend(monkeypatch):
    from turboquant.attention import device

    gpu_upload._driver.cache_clear()
    monkeypatch.setattr(device, "backend", lambda: None)
    try:
        assert gpu_upload._driver() is None and not gpu_upload.available() and not gpu_upload.prepare()
        assert gpu_upload.to_gpu([mx.zeros((1 << 20,), dtype=mx.uint8)]) is False
        with pytest.raises(gpu_upload.Unavailable):
            gpu_upload.read_tensors(0, [])
    finally:
        gpu_upload._driver.cache_clear()


def test_a_refusing_driver_leaves_the_arrays_to_the_page_faults(monkeypatch):
    class Refusing:
        calls = []

        def prefetch(self, spans):
            self.calls.append(spans)
            raise gpu_upload.Unavailable("cuMemPrefetchAsync returned CUresult 1")

    drv = Refusing()
    monkeypatch.setattr(gpu_upload, "_driver", lambda: drv)
    big, small = mx.ones((1 << 18,), dtype=mx.float32), mx.ones((8,), dtype=mx.float32)
    mx.eval(big, small)
    assert gpu_upload.to_gpu([big, small]) is False
    assert drv.calls == [[(gpu_upload.address(big), big.nbytes)]]  # small arrays are left to their faults
    assert mx.array_equal(big, mx.ones((1 << 18,))).item()


class HostCopyDriver:
    """The driver's calls on host memory (this CPU build's arrays are host
    memory): a copy is a memmove, done at once; events and streams are no-ops."""

    def __init__(self, chunk: int, threads: int = 3):
        self.copies = []
        self._bufs = []
        q = queue.Queue()
        for _ in range(threads):
            slot = type("Slot", (), {})()
            bufs = [ctypes.create_string_buffer(chunk) for _ in range(2)]
            self._bufs += bufs
            slot.buffers = [ctypes.c_void_p(ctypes.addressof(b)) for b in bufs]
            slot.views = [memoryview(b).cast("B")[:chunk] for b in bufs]
            slot.events = [object(), object()]
            slot.stream = object()
            q.put(slot)
        self.q = q
        drv = self

        class Lib:
            def cuMemcpyHtoDAsync_v2(self, dst, src, n, stream):
                drv.copies.append((dst, n))
                ctypes.memmove(dst, src.value, n)
                return 0

            def cuEventSynchronize(self, e):
                return 0

            def cuEventRecord(self, e, s):
                return 0

            def cuStreamSynchronize(self, s):
                return 0

        self.lib = Lib()

    check = staticmethod(gpu_upload._Driver.check)

    def bind(self):
        pass

    def slots(self):
        return self.q


def test_prepare_makes_the_reader_slots_before_the_first_read(monkeypatch):
    """What an engine's warm-up calls: the slots exist afterwards (made once),
    and a driver that refuses them is a False, not an error."""
    made = []

    class Drv:
        def slots(self):
            made.append(1)
            return queue.Queue()

    monkeypatch.setattr(gpu_upload, "_driver", lambda: Drv())
    assert gpu_upload.prepare() is True and made == [1]

    class Refusing:
        def slots(self):
            raise gpu_upload.Unavailable("cuMemHostAlloc returned CUresult 2")

    monkeypatch.setattr(gpu_upload, "_driver", lambda: Refusing())
    assert gpu_upload.prepare() is False


def _file_of(tmp_path, tensors: dict[str, bytes]):
    data, spans, off = b"", [], 16
    for name, raw in tensors.items():
        spans.append(gpu_upload.TensorSpan(name, off + len(data), len(raw), mx.uint8, (len(raw),)))
        data += raw
    p = tmp_path / "t.bin"
    p.write_bytes(b"\x07" * 16 + data)
    return p, spans


def test_staged_reads_copy_every_piece_to_its_place_and_checksum_it(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_upload, "CHUNK", 1000)
    drv = HostCopyDriver(1000)
    monkeypatch.setattr(gpu_upload, "_driver", lambda: drv)
    tensors = {"a": bytes(range(256)) * 17, "b": b"", "c": bytes([9]) * 999, "d": bytes(reversed(range(256))) * 40}
    path, spans = _file_of(tmp_path, tensors)
    with open(path, "rb") as f:
        arrays, crcs = gpu_upload.read_tensors(f.fileno(), spans)
    for name, raw in tensors.items():
        assert bytes(memoryview(arrays[name])) == raw
        assert crcs[name] == zlib.crc32(raw)
    assert len(drv.copies) == sum(-(-len(r) // 1000) for r in tensors.values())  # 1000-byte pieces


def test_a_file_cut_short_is_an_eof_error_after_every_reader_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_upload, "CHUNK", 512)
    drv = HostCopyDriver(512, threads=2)
    monkeypatch.setattr(gpu_upload, "_driver", lambda: drv)
    path, spans = _file_of(tmp_path, {"a": b"x" * 3000, "b": b"y" * 3000})
    path.write_bytes(path.read_bytes()[:-100])
    with open(path, "rb") as f, pytest.raises(EOFError, match="cut short"):
        gpu_upload.read_tensors(f.fileno(), spans)
    assert drv.q.qsize() == 2  # every slot back in the pool
