"""gpu_prefetch: array addresses are exact, and without CUDA nothing is moved."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import pytest

from pipeline.inference import gpu_prefetch


@pytest.mark.parametrize("dtype", [mx.uint32, mx.float16, mx.bfloat16, mx.float32])
def test_address_is_the_first_byte_of_the_array_and_its_slices(dtype):
    a = (mx.arange(4096) * 3 + 1).astype(dtype)
    tail = a[100:]
    mx.eval(a, tail)
    raw = mx.view(a, mx.uint8)
    first = bytes(memoryview(raw)[: 4])
    assert ctypes.string_at(gpu_prefetch.address(a), 4) == first
    step = a.itemsize * 100
    assert ctypes.string_at(gpu_prefetch.address(tail), 4) == bytes(memoryview(raw)[step : step + 4])


def test_nothing_moves_without_a_cuda_backend(monkeypatch):
    from turboquant.attention import device

    gpu_prefetch._driver.cache_clear()
    monkeypatch.setattr(device, "backend", lambda: None)
    try:
        assert gpu_prefetch._driver() is None
        assert gpu_prefetch.to_gpu([mx.zeros((1 << 20,), dtype=mx.uint8)]) is False
    finally:
        gpu_prefetch._driver.cache_clear()


def test_a_refusing_driver_leaves_the_arrays_to_the_page_faults(monkeypatch):
    class Refusing:
        calls = []

        def prefetch(self, spans):
            self.calls.append(spans)
            raise OSError("cuMemPrefetchAsync returned CUresult 1")

    drv = Refusing()
    monkeypatch.setattr(gpu_prefetch, "_driver", lambda: drv)
    big, small = mx.ones((1 << 18,), dtype=mx.float32), mx.ones((8,), dtype=mx.float32)
    mx.eval(big, small)
    assert gpu_prefetch.to_gpu([big, small]) is False
    assert drv.calls == [[(gpu_prefetch.address(big), big.nbytes)]]  # small arrays are left to their faults
    assert mx.array_equal(big, mx.ones((1 << 18,))).item()
