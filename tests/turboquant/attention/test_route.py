"""The kernel decision (turboquant/attention/route.py): every route from sizes alone, no GPU."""

from __future__ import annotations

import dataclasses

import pytest

from turboquant.attention import Call, Route, choose, device, table
from turboquant.attention.route import dequant_bytes, split_k_route

# a decode step of a GQA-4 model at 3.5 bits: 8 query heads, 2 kv heads, d=128
STEP = Call(batch=1, q_heads=8, kv_heads=2, length=1, head_dim=128, window_key_dim=128, value_dim=128,
            window=16, packed=4096, capacity=4096, key_bits=3, value_bits=4, itemsize=2, codec_dim=128,
            scalar_codes=True, hadamard=True, packed_mask=False, window_mask=False, sinks=False, on_gpu=True)


def call(**kw) -> Call:
    return dataclasses.replace(STEP, **kw)


def test_mode_parsing(monkeypatch):
    monkeypatch.delenv("TQ_KERNELS", raising=False)
    assert device.mode() == "auto"
    monkeypatch.setenv("TQ_KERNELS", " GPU ")
    assert device.mode() == "gpu"
    monkeypatch.setenv("TQ_KERNELS", "fast")
    with pytest.raises(ValueError, match="TQ_KERNELS='fast'"):
        device.mode()


@pytest.mark.skipif(device.backend() is not None, reason="checks the no-GPU dispatch")
def test_dispatch_without_gpu(monkeypatch):
    monkeypatch.setenv("TQ_KERNELS", "auto")
    assert device.use_kernels() is False
    monkeypatch.setenv("TQ_KERNELS", "reference")
    assert device.use_kernels() is False
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    with pytest.raises(RuntimeError, match="neither Metal nor CUDA"):
        device.use_kernels()


def test_settings_and_device_pick_the_reference_path():
    assert choose(STEP, "cuda", "reference") is Route.REFERENCE
    assert choose(call(on_gpu=False), "cuda", "auto") is Route.REFERENCE  # CPU stream
    assert choose(STEP, None, "auto") is Route.REFERENCE
    assert choose(call(on_gpu=False), "cuda", "gpu") is Route.FUSED_STEP  # forced
    with pytest.raises(RuntimeError, match="neither Metal nor CUDA"):
        choose(STEP, None, "gpu")


@pytest.mark.parametrize("change", [dict(sinks=True), dict(packed=0), dict(head_dim=96, window_key_dim=96,
                                    value_dim=96, codec_dim=96), dict(scalar_codes=False), dict(window_key_dim=64),
                                    dict(codec_dim=64)])
def test_what_the_kernels_do_not_cover_goes_to_the_reference_path(change):
    for be in ("cuda", "metal"):
        assert choose(call(**change), be, "auto") is Route.REFERENCE


def test_cuda_decode_steps():
    assert choose(STEP, "cuda", "auto") is Route.FUSED_STEP
    # what the fused step does not take: the tc8 kernel with the ops around it
    for change in (dict(window_mask=True), dict(hadamard=False), dict(window=0), dict(value_dim=64),
                   dict(window=table.fused_max_window(128, 4) + 1)):
        assert choose(call(**change), "cuda", "auto") is Route.TC8, change
    assert choose(call(window=table.fused_max_window(128, 4)), "cuda", "auto") is Route.FUSED_STEP
    assert choose(call(q_heads=16), "cuda", "auto") is Route.FUSED_STEP  # 8 rows: still tc8
    assert choose(call(q_heads=18, kv_heads=2), "cuda", "auto") is Route.TC  # 9 rows: 16-row tiles


def test_cuda_prefill_chunks():
    """Short chunks read the codes in place (tc); from PREFILL_SDPA_ROWS rows
    per kv head the history is dequantized for one fused SDPA while the
    temporary fits, and past PREFILL_DEQUANT_BYTES tc runs again."""
    rows = table.PREFILL_SDPA_ROWS  # GQA 4: a chunk of rows / 4 tokens
    short = call(length=rows // 4 - 1, window=rows // 4 + 15, window_mask=True)
    assert choose(short, "cuda", "auto") is Route.TC
    chunk = call(length=rows // 4, window=rows // 4 + 16, window_mask=True)
    assert choose(chunk, "cuda", "auto") is Route.DEQUANT_SDPA
    assert choose(call(length=2048, window=2048 + 16, window_mask=True), "cuda", "auto") is Route.DEQUANT_SDPA
    per_token = dequant_bytes(call(length=2048, window=0, packed=1))  # bytes per history token
    longest = table.PREFILL_DEQUANT_BYTES // per_token - 2048 - 16
    assert choose(call(length=2048, window=2048 + 16, packed=longest), "cuda", "auto") is Route.DEQUANT_SDPA
    assert choose(call(length=2048, window=2048 + 16, packed=longest + 1), "cuda", "auto") is Route.TC
    # a mask into the packed history: dequantize + SDPA, or blockwise when too big
    assert choose(call(length=64, packed_mask=True), "cuda", "auto") is Route.DEQUANT_SDPA
    assert choose(call(length=64, packed_mask=True, packed=1 << 22), "cuda", "auto") is Route.REFERENCE


def test_split_k_kernel_by_head_dim_capacity_and_rows():
    assert split_k_route("cuda", 128, 4096, 4) is Route.TC8
    assert split_k_route("cuda", 64, 4096, 8) is Route.TC8
    assert split_k_route("cuda", 128, 4096, 9) is Route.TC
    assert split_k_route("cuda", 256, 4096, 4) is Route.SIMT
    assert split_k_route("cuda", 128, 4095, 4) is Route.SIMT  # norms are loaded in pairs
    assert split_k_route("metal", 128, 4096, 4) is Route.SIMT
    assert choose(call(head_dim=256, window_key_dim=256, value_dim=256, codec_dim=256), "cuda", "auto") is Route.SIMT
    assert choose(call(capacity=4095), "cuda", "auto") is Route.SIMT


def test_apple_gpus_run_the_shared_kernels():
    assert choose(STEP, "metal", "auto") is Route.SIMT
    assert choose(call(length=4), "metal", "auto") is Route.SIMT  # 16 rows
    assert choose(call(length=5), "metal", "auto") is Route.DEQUANT_SDPA  # 20 rows > PREFILL_ROWS
    assert choose(call(window_mask=True), "metal", "auto") is Route.SIMT
    assert choose(call(packed_mask=True), "metal", "auto") is Route.DEQUANT_SDPA


def test_dequant_limit_bounds_the_prefill_temporary():
    """Past PREFILL_DEQUANT_BYTES the prefill goes blockwise instead of
    dequantizing the whole history: no whole-cache temporary on any route."""
    c = call(length=64)
    assert dequant_bytes(c) == 2 * 2 * 2 * (4096 + 16) * 128 * 2
    n = table.PREFILL_DEQUANT_BYTES // (2 * 2 * 2 * 128 * 2) - 16  # fits exactly
    assert dequant_bytes(call(length=64, packed=n)) == table.PREFILL_DEQUANT_BYTES
    assert choose(call(length=64, packed=n), "metal", "auto") is Route.DEQUANT_SDPA
    assert choose(call(length=64, packed=n + 1), "metal", "auto") is Route.REFERENCE


def test_describe_reads_the_call(monkeypatch):
    from packed_fixtures import codec_quantize, filled_cache

    from turboquant.attention import launchers
    from turboquant.attention.route import describe
    import mlx.core as mx

    monkeypatch.setattr(launchers, "quantize_any", codec_quantize)
    cache = filled_cache(3.5, 128, 2, 300)
    k = mx.random.normal((1, 2, 1, 128)).astype(mx.float16)
    wk, wv = cache.update_and_fetch(k, k)
    q = mx.random.normal((1, 8, 1, 128)).astype(mx.float16)
    c = describe(q, wk, wv, cache, None, None, None, True)
    assert (c.rows, c.packed, c.window, c.key_bits, c.value_bits, c.itemsize) == (4, cache.packed_len,
                                                                                  wk.shape[2], 4, 3, 2)
    assert c.hadamard and c.scalar_codes and c.capacity == cache.keys_norms.shape[2]
    assert choose(c, "cuda", "auto") is Route.FUSED_STEP
