"""kv_file: a prefilled cache round-trips bit-exactly and every bad file is refused."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from pipeline.inference import kv_file
from pipeline.inference.kv_file import CacheFileError, UnsupportedCache
from tiny_models import prompt_tokens, tiny_llama
from turboquant import TurboQuantKVCache, make_prompt_cache

KEY = {"doc": "abc", "version": kv_file.FORMAT_VERSION}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, num_hidden_layers=2)


def prefill(model, scheme: str, n: int = 300, **opts):
    caches = make_prompt_cache(model, kv_quant_scheme=scheme, **opts)
    toks = prompt_tokens(n)
    for s in range(0, n, 128):
        model(toks[None, s : s + 128], cache=caches)
        mx.eval([c.state for c in caches])
    return caches, toks.tolist()


def _states_equal(a_caches, b_caches) -> bool:
    """Every array leaf of the layers' states bit-equal."""
    for a, b in zip(a_caches, b_caches):
        for x, y in zip(tree_flatten(a.state), tree_flatten(b.state)):
            if isinstance(x[1], mx.array) and not mx.array_equal(x[1], y[1]).item():
                return False
    return True


def greedy(model, caches, start: int, steps: int = 6) -> list[int]:
    out, tok = [], start
    for _ in range(steps):
        logits = model(mx.array([[tok]]), cache=caches)
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
    return out


@pytest.mark.parametrize("scheme,opts", [
    ("turboquant", {"kv_bits": 3.5, "window": 32}),
    ("turboquant", {"kv_bits": 2.5, "window": 0}),
    ("fp16", {}),
    ("affine", {"kv_bits": 4, "affine_group_size": 32}),
])
@pytest.mark.parametrize("writer", ["host", "cuda-copies"])
def test_round_trip_continues_exactly_like_the_original(tmp_path, model, scheme, opts, writer, monkeypatch):
    caches, ids = prefill(model, scheme, **opts)
    path = tmp_path / "c.safetensors"
    if writer == "cuda-copies":  # the writer's CUDA path (device copies of every tensor), run on this CPU
        from turboquant.attention import device

        monkeypatch.setattr(device, "backend", lambda: "cuda")
        monkeypatch.setattr(device, "on_gpu", lambda: True)
    nbytes = kv_file.write(path, caches, ids, key=KEY, info={"length": len(ids)})
    monkeypatch.undo()
    assert nbytes == path.stat().st_size
    got = kv_file.read(path, key=KEY)
    assert got.prefix_ids == ids and got.info == {"length": len(ids)} and got.key == KEY
    assert [type(c) for c in got.caches] == [type(c) for c in caches]
    assert [c.offset for c in got.caches] == [len(ids)] * len(caches)
    assert greedy(model, got.caches, ids[-1]) == greedy(model, caches, ids[-1])


def test_turboquant_file_holds_the_used_bytes_only(tmp_path, model):
    caches, ids = prefill(model, "turboquant", n=600, kv_bits=3.5, window=64)
    for c in caches:
        c.reserve(4096)  # spare capacity is not written
    path = tmp_path / "c.safetensors"
    kv_file.write(path, caches, ids, key=KEY, info={})
    used = sum(c.used_nbytes for c in caches)
    assert used < path.stat().st_size < used * 1.05 + 4 * len(ids) + 16384
    back = kv_file.read(path).caches
    assert all(b.packed_len == c.packed_len and b.window_len == c.window_len for b, c in zip(back, caches))


def test_stepped_caches_are_written_without_spare_capacity(tmp_path, model):
    caches, ids = prefill(model, "fp16", n=300)  # KVCache holds 384 slots
    path = tmp_path / "c.safetensors"
    kv_file.write(path, caches, ids, key=KEY, info={})
    assert path.stat().st_size < sum(c.nbytes for c in caches) * 300 / 384 * 1.02


def test_unsupported_layer_class_writes_nothing(tmp_path):
    with pytest.raises(UnsupportedCache):
        kv_file.write(tmp_path / "c.safetensors", [RotatingKVCache(max_size=8)], [1], key=KEY, info={})
    assert list(tmp_path.iterdir()) == []


def _written(tmp_path, model):
    caches, ids = prefill(model, "turboquant", n=200, kv_bits=3, window=16)
    path = tmp_path / "c.safetensors"
    kv_file.write(path, caches, ids, key=KEY, info={})
    return path


def test_truncated_file_is_refused(tmp_path, model):
    path = _written(tmp_path, model)
    data = path.read_bytes()
    for cut in (3, 100, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(CacheFileError):
            kv_file.read(path, key=KEY)


def test_flipped_byte_fails_the_checksum(tmp_path, model):
    path = _written(tmp_path, model)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="checksum"):
        kv_file.read(path, key=KEY)


@pytest.mark.parametrize("where", [0.3, 0.6, 0.9])
def test_a_flipped_byte_anywhere_fails_its_tensor_checksum_in_small_blocks(tmp_path, model, monkeypatch, where):
    """Tensors are checked in blocks, in threads, while MLX loads the file:
    a byte flipped in any tensor, inside any block, is found."""
    monkeypatch.setattr(kv_file, "_CRC_BLOCK", 64)
    path = _written(tmp_path, model)
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # safetensors: header length, header, tensor bytes
    data[start + int((len(data) - start) * where)] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="checksum mismatch in tensor"):
        kv_file.read(path, key=KEY)


def test_another_key_or_version_or_format_is_refused(tmp_path, model):
    path = _written(tmp_path, model)
    with pytest.raises(CacheFileError, match="differs in: doc"):
        kv_file.read(path, key={**KEY, "doc": "other"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    for field, value, match in (("version", "999", "version 999"), ("format", "x", "not a")):
        h = json.loads(json.dumps(header))
        h["__metadata__"][field] = value
        blob = json.dumps(h).encode()
        path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
        with pytest.raises(CacheFileError, match=match):
            kv_file.read(path, key=KEY)
    path.write_bytes(b"not a cache at all")
    with pytest.raises(CacheFileError):
        kv_file.read(path)


def test_a_file_naming_an_unknown_class_is_refused(tmp_path, model):
    path = _written(tmp_path, model)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"]["layers"] = json.dumps(["os.system", "os.system"])
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    with pytest.raises(CacheFileError, match="unknown cache classes"):
        kv_file.read(path)


def test_write_leaves_no_temporary_file(tmp_path, model):
    path = _written(tmp_path, model)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_class_ids():
    assert kv_file.class_id(TurboQuantKVCache()) == "turboquant.TurboQuantKVCache"
    assert kv_file.class_id(KVCache()) == "mlx_lm.KVCache"
    assert kv_file.class_id(QuantizedKVCache()) == "mlx_lm.QuantizedKVCache"


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_caches_round_trip_bit_exactly(tmp_path, dtype):
    cache = KVCache()
    k = mx.random.normal((1, 2, 40, 64)).astype(dtype)
    cache.update_and_fetch(k, -k)
    kv_file.write(tmp_path / "c.safetensors", [cache], [1, 2], key=KEY, info={})
    (back,) = kv_file.read(tmp_path / "c.safetensors", key=KEY).caches
    assert back.keys.dtype == dtype and back.offset == 40
    assert mx.array_equal(back.keys, k).item() and mx.array_equal(back.values, -k).item()


def test_the_loader_checks_the_file_and_never_reads_a_loaded_array(tmp_path, model, monkeypatch):
    """On CUDA the host reading an array moves it out of GPU memory for good:
    the checksums are taken on the file's bytes, not on the loaded arrays."""
    path = _written(tmp_path, model)

    def host_read(a):
        raise AssertionError("the loader read an MLX array on the host")

    monkeypatch.setattr(kv_file, "_crc", host_read)
    assert kv_file.read(path, key=KEY).prefix_ids


@pytest.mark.parametrize("renames", [1, kv_file.READ_ATTEMPTS])
def test_a_file_replaced_while_it_is_read_is_read_again(tmp_path, model, monkeypatch, renames):
    """Where the system cannot name an open file (no /proc/self/fd or
    /dev/fd), mx.load reopens the path: a writer of the same key renaming
    its file into place mid-read makes the read start over on the new file;
    a path that keeps changing is refused.  (One load stream: a rename per
    read attempt.)"""
    monkeypatch.setattr(kv_file, "_handle_path", lambda fd: None)
    monkeypatch.setattr(kv_file, "_load_streams", lambda: (mx.cpu,))
    path = _written(tmp_path, model)
    data = path.read_bytes()
    real_load = mx.load
    left = [renames]

    def load_then_replace(p, **kwargs):
        arrays = real_load(p, **kwargs)
        if left[0]:
            left[0] -= 1
            other = tmp_path / f"other{left[0]}.safetensors"
            other.write_bytes(data)
            other.replace(path)
        return arrays

    monkeypatch.setattr(mx, "load", load_then_replace)
    if renames < kv_file.READ_ATTEMPTS:
        assert kv_file.read(path, key=KEY).prefix_ids
    else:
        with pytest.raises(CacheFileError, match="replaced while it was read"):
            kv_file.read(path, key=KEY)


def test_a_file_replaced_on_every_read_is_read_whole_from_the_first_file(tmp_path, model, monkeypatch):
    """mx.load opens the handle's own file: however often writers rename new
    files over the path (here a cache of another document, at every load),
    the read returns the file it opened first, complete, without a retry."""
    path = _written(tmp_path, model)
    first = kv_file.read(path, key=KEY)
    caches, ids = prefill(model, "turboquant", n=120, kv_bits=3, window=16)
    other = tmp_path / "other.safetensors"
    kv_file.write(other, caches, ids, key={**KEY, "doc": "other"}, info={})
    data, real_load, loads = other.read_bytes(), mx.load, []

    def load_then_replace(p, **kwargs):
        loads.append(p)
        arrays = real_load(p, **kwargs)
        fresh = tmp_path / f"next{len(loads)}.safetensors"
        fresh.write_bytes(data)
        fresh.replace(path)
        return arrays

    monkeypatch.setattr(mx, "load", load_then_replace)
    got = kv_file.read(path, key=KEY)
    assert len(loads) == kv_file.LOAD_STREAMS and got.prefix_ids == first.prefix_ids != ids
    assert got.key == KEY


def test_tensors_load_on_cpu_streams_side_by_side(tmp_path, model, monkeypatch):
    """On CUDA, mx.load on the GPU stream took 3x as long (H100, 3.9 GB:
    2.3 s against 0.76 s with the GPU's first touch), so the read names
    CPU streams whatever the default device is; ``LOAD_STREAMS`` of them,
    each evaluating its own share of the tensors, every tensor once."""
    path = _written(tmp_path, model)
    want = kv_file.read(path, key=KEY)
    real_load, streams = mx.load, []

    def recording_load(p, **kwargs):
        streams.append(kwargs.get("stream"))
        return real_load(p, **kwargs)

    monkeypatch.setattr(mx, "load", recording_load)
    got = kv_file.read(path, key=KEY)
    assert len(streams) == kv_file.LOAD_STREAMS
    assert streams[0] == mx.cpu and all(s.device == mx.cpu for s in streams[1:])
    assert all(a != b for i, a in enumerate(streams[1:]) for b in streams[i + 2:])
    assert got.prefix_ids == want.prefix_ids and _states_equal(got.caches, want.caches)


def test_tensors_are_dealt_to_the_streams_by_size():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 40, "e": 10, "f": 0}
    shares = kv_file.deal_by_size(sizes, 3)
    assert sorted(n for s in shares for n in s) == sorted(sizes)
    assert [sum(sizes[n] for n in s) for s in shares] == [100, 70, 90]
    assert kv_file.deal_by_size({"a": 5}, 4) == [["a"], [], [], []]


def test_the_read_asks_for_the_gpu_move_of_every_cache_tensor(tmp_path, model, monkeypatch):
    """Loaded tensors go to the GPU in bulk (where the backend allows: False
    on this CPU build); the token ids, read on the host, stay out."""
    path = _written(tmp_path, model)
    moved = []

    def fake_to_gpu(arrays):
        moved.extend(arrays)
        return True

    monkeypatch.setattr(kv_file.gpu_upload, "to_gpu", fake_to_gpu)
    got = kv_file.read(path, key=KEY)
    assert got.on_gpu is True
    entries = kv_file._header(path)[2]
    assert len(moved) == len(entries) - 1  # every tensor but prefix_ids
    assert not any(m.ndim == 1 and m.dtype == mx.int32 and m.size == len(got.prefix_ids) for m in moved)
    monkeypatch.undo()
    assert kv_file.read(path, key=KEY).on_gpu is False  # this CPU-only build


def test_the_writer_reads_bit_exact_device_copies_on_cuda(monkeypatch):
    from turboquant.attention import device

    a = mx.array([[-0.0, 1.5], [float("nan"), 3.0]], dtype=mx.bfloat16)
    monkeypatch.setattr(device, "backend", lambda: "cuda")
    monkeypatch.setattr(device, "on_gpu", lambda: True)
    copy = kv_file._host_readable(a)
    assert copy.dtype == a.dtype and copy.shape == a.shape
    assert mx.array_equal(mx.view(copy, mx.uint16), mx.view(a, mx.uint16)).item()  # -0.0 and NaN bits kept
    assert kv_file._host_readable(mx.zeros((0, 4), dtype=mx.uint8)).shape == (0, 4)


@pytest.mark.parametrize("kind", ["KVCache", "QuantizedKVCache"])
def test_mlx_vlm_caches_round_trip(tmp_path, kind):
    """mlx-vlm's from_state takes the meta_state (its QuantizedKVCache keeps
    offset, group size and bits there): without it no VLM entry with these
    caches could be loaded back."""
    from mlx_vlm.models import cache as vlm

    cls = getattr(vlm, kind)
    caches = [cls() if kind == "KVCache" else cls(group_size=32, bits=4) for _ in range(2)]
    for i, c in enumerate(caches):
        k = mx.random.normal((1, 2, 5, 64), key=mx.random.key(i))
        c.update_and_fetch(k, -k)
    path = tmp_path / "vlm.safetensors"
    kv_file.write(path, caches, [1, 2, 3, 4, 5], key=KEY, info={})
    got = kv_file.read(path, key=KEY)
    assert [type(c) for c in got.caches] == [cls, cls]
    assert [c.offset for c in got.caches] == [5, 5] and [c.meta_state for c in got.caches] == [c.meta_state for c in caches]
    assert _states_equal(got.caches, caches)


def test_reading_a_text_models_cache_does_not_import_mlx_vlm(tmp_path, model):
    """Importing mlx-vlm costs ~0.1-0.2 s; a text model's first load must not pay it."""
    import subprocess
    import sys

    path = _written(tmp_path, model)
    code = ("import sys, turboquant; from pipeline.inference import kv_file; "
            f"f = kv_file.read({str(path)!r}, key={KEY!r}); "
            "assert len(f.caches) == 2; print('mlx_vlm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _host_upload(monkeypatch):
    """The staged GPU reader on this CPU build: its copies are memmoves."""
    from test_gpu_upload import HostCopyDriver

    monkeypatch.setattr(kv_file.gpu_upload, "CHUNK", 4096)
    drv = HostCopyDriver(4096)
    monkeypatch.setattr(kv_file.gpu_upload, "_driver", lambda: drv)
    return drv


@pytest.fixture
def host_upload(monkeypatch):
    return _host_upload(monkeypatch)


def test_the_staged_reader_gives_the_plain_reads_caches(tmp_path, model, monkeypatch):
    path = _written(tmp_path, model)
    plain = kv_file.read(path, key=KEY)
    assert plain.on_gpu is False
    drv = _host_upload(monkeypatch)
    monkeypatch.setattr(mx, "load", lambda *a, **k: pytest.fail("the staged reader must not call mx.load"))
    staged = kv_file.read(path, key=KEY)
    assert staged.on_gpu is True and drv.copies
    assert staged.prefix_ids == plain.prefix_ids and _states_equal(staged.caches, plain.caches)


def test_the_staged_reader_refuses_a_flipped_byte(tmp_path, model, host_upload):
    path = _written(tmp_path, model)
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="checksum mismatch"):
        kv_file.read(path, key=KEY)


def test_a_refused_upload_falls_back_to_the_plain_read(tmp_path, model, monkeypatch):
    path = _written(tmp_path, model)
    plain = kv_file.read(path, key=KEY)

    def refuse(fd, spans):
        raise kv_file.gpu_upload.Unavailable("cuMemHostAlloc returned CUresult 2")

    monkeypatch.setattr(kv_file.gpu_upload, "available", lambda: True)
    monkeypatch.setattr(kv_file.gpu_upload, "read_tensors", refuse)
    got = kv_file.read(path, key=KEY)
    assert got.prefix_ids == plain.prefix_ids and _states_equal(got.caches, plain.caches)
