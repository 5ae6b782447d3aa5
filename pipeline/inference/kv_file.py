"""One prefilled document's KV cache as one safetensors file.

File layout (safetensors: 8-byte little-endian header length, JSON header,
raw tensor bytes)::

    tensors   "prefix_ids"            int32 [n]   the document prefix's token ids
              "kv.<layer>.<i>[.<j>]"  the array leaves of each layer's ``state``
    metadata  "format"   "tqpipe-doc-cache"
              "version"  FORMAT_VERSION (a file of another version is never read)
              "key"      JSON: what the cache was computed from (the store's key fields)
              "info"     JSON: what the engine needs to continue (document length,
                         position offsets) plus descriptive fields for listings
              "layers"   JSON: one class id per layer (``class_id``)
              "leaves"   JSON: the non-array leaves of the states (ints, strings, None)
              "crc32"    JSON: CRC-32 of every tensor's bytes
              "meta_state" JSON: layer index -> ``meta_state``, for the classes
                         whose ``from_state`` takes it (mlx-vlm's)

A layer is saved through its own ``state`` protocol, the one mlx-lm's
``save_prompt_cache`` uses (``TurboQuantKVCache.state`` carries its packed
codes sliced to the packed length, norms, means, exact window and its meta
strings), and rebuilt with ``cls.from_state``.  Only the classes in
``_class_table`` are written or read: a file names classes, and reading must
never import whatever a file names.  Caches that grow in steps (mlx-lm's
``KVCache``/``QuantizedKVCache``) are sliced to their ``offset`` first, so the
file holds the tokens and not the spare capacity.

Every failure to read (missing tensors, a truncated or foreign file, another
version, a checksum or shape mismatch) raises ``CacheFileError``: the caller
treats the file as absent.  ``write`` is atomic: it writes a hidden temporary
sibling, fsyncs it, renames it into place and fsyncs the folder, so a reader
sees either no file or a whole one, and two writers of the same path each
rename a complete file (the last one wins).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import gpu_upload

log = logging.getLogger(__name__)

FORMAT = "tqpipe-doc-cache"
# 2: keyed by the reading, not the token ids; names start with the content hash.
# 3: the scalar quantizer searches a scale per vector: a fresh prefill no
#    longer reproduces a version-2 entry bit for bit (which loading promises).
FORMAT_VERSION = 3
SUFFIX = ".safetensors"
TEMP_MARK = ".tmp"  # temporary files: "." + name + TEMP_MARK + unique + SUFFIX
_MAX_HEADER = 64 << 20


class CacheFileError(Exception):
    """A cache file that cannot be used (the message says why)."""


class UnsupportedCache(Exception):
    """A layer cache whose class this file format does not store."""


def _class_table(vlm: bool = False) -> dict[str, type]:
    """Class id -> class, for every cache this format stores; mlx-vlm's
    classes only with ``vlm`` (a file or a cache that names them): importing
    mlx-vlm costs ~0.1-0.2 s, which a text model's first load would pay."""
    from mlx_lm.models import cache as lm

    from turboquant.cache import TurboQuantKVCache

    table: dict[str, type] = {
        "turboquant.TurboQuantKVCache": TurboQuantKVCache,
        "mlx_lm.KVCache": lm.KVCache,
        "mlx_lm.QuantizedKVCache": lm.QuantizedKVCache,
    }
    if vlm:
        try:
            from mlx_vlm.models import cache as vlm_cache

            table["mlx_vlm.KVCache"] = vlm_cache.KVCache
            table["mlx_vlm.QuantizedKVCache"] = vlm_cache.QuantizedKVCache
        except ImportError:
            pass
    return table


def _names_vlm(ids: list) -> bool:
    return any(isinstance(c, str) and c.startswith("mlx_vlm.") for c in ids)


_STEPPED = ("KVCache", "QuantizedKVCache")  # state holds spare capacity past offset
# classes whose from_state takes the meta_state too (mlx-vlm's: its
# QuantizedKVCache keeps offset, group size and bits there, not in state)
_META_STATE = ("mlx_vlm.KVCache", "mlx_vlm.QuantizedKVCache")


def _meta_state(cache: Any) -> Any:
    m = cache.meta_state
    return list(m) if isinstance(m, tuple) else m


def class_id(cache: Any) -> str:
    """The id a layer cache is stored under; ``UnsupportedCache`` if none."""
    for cid, cls in _class_table(type(cache).__module__.startswith("mlx_vlm")).items():
        if type(cache) is cls:
            return cid
    raise UnsupportedCache(f"{type(cache).__module__}.{type(cache).__name__}")


def _layer_state(cache: Any, cid: str) -> Any:
    state = cache.state
    if cid.split(".", 1)[1] in _STEPPED and cache.offset:
        n = cache.offset
        state = tree_map(lambda a: a[:, :, :n] if isinstance(a, mx.array) and a.ndim == 4 else a, state)
    return state


def _crc(a: mx.array) -> int:
    """CRC-32 of a row-contiguous array's bytes (any dtype, bfloat16 included)."""
    return zlib.crc32(memoryview(mx.view(a, mx.uint8)))


def _host_readable(a: mx.array) -> mx.array:
    """``a`` as the writer may read it on the host, row-contiguous.

    On CUDA the host reading an array's memory moves that array out of the
    GPU into unified memory for good, which would leave the live cache the
    tasks are about to read in host-side memory; so the writer reads a
    bit-exact device copy instead (bytes, so -0.0 and NaN payloads survive).
    """
    from turboquant.attention import device

    a = mx.contiguous(a)
    if device.backend() == "cuda" and device.on_gpu() and a.size:
        a = mx.view(mx.view(a, mx.uint8) + 0, a.dtype)
    return a


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


@dataclass
class CacheFile:
    """What a cache file holds, rebuilt."""

    caches: list
    prefix_ids: list[int]
    key: dict
    info: dict
    on_gpu: bool = False  # moved into GPU memory in bulk by the read (CUDA)


def write(path: Path, caches: list, prefix_ids: list[int], *, key: dict, info: dict) -> int:
    """Write ``caches`` atomically to ``path``; returns the file's size in bytes.

    Raises ``UnsupportedCache`` (before writing anything) if a layer's class
    is not stored by this format.
    """
    path = Path(path)
    ids = [class_id(c) for c in caches]
    tensors: dict[str, mx.array] = {"prefix_ids": mx.array(list(prefix_ids), dtype=mx.int32)}
    leaves: list[list] = []
    for path_key, leaf in tree_flatten([_layer_state(c, cid) for c, cid in zip(caches, ids)]):
        if isinstance(leaf, mx.array):
            tensors[f"kv.{path_key}"] = leaf
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            leaves.append([path_key, leaf])
        else:
            raise UnsupportedCache(f"state leaf {path_key} of type {type(leaf).__name__}")
    tensors = {name: _host_readable(a) for name, a in tensors.items()}  # shared by CRC and save
    mx.eval(list(tensors.values()))
    metadata = {
        "format": FORMAT,
        "version": str(FORMAT_VERSION),
        "key": _dumps(key),
        "info": _dumps(info),
        "layers": _dumps(ids),
        "leaves": _dumps(leaves),
        "crc32": _dumps({name: _crc(a) for name, a in tensors.items()}),
        "meta_state": _dumps({str(i): _meta_state(c) for i, (c, cid) in enumerate(zip(caches, ids))
                              if cid in _META_STATE}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}{TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}{SUFFIX}")
    try:
        mx.save_safetensors(str(tmp), tensors, metadata)
        _fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return path.stat().st_size


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_header(path: Path) -> tuple[dict, int]:
    """``(metadata, expected file size)`` from the header alone (no tensor bytes read).

    Checks the format name, the version and that the file is as long as its
    header says, so listings and lookups reject truncated and foreign files
    cheaply.
    """
    meta, size, _, _ = _header(path)
    return meta, size


def _header(path: Path) -> tuple[dict, int, dict, int]:
    """``(metadata, file size, tensor entries, offset of the tensor bytes)``, checked."""
    try:
        with open(path, "rb") as f:
            return _parse_header(f)
    except OSError as e:
        raise CacheFileError(f"cannot read: {e}") from e


def _parse_header(f: Any) -> tuple[dict, int, dict, int]:
    """:func:`_header` of an open file (read from its start)."""
    try:
        f.seek(0)
        raw = f.read(8)
        if len(raw) < 8:
            raise CacheFileError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise CacheFileError("not a safetensors file (header length out of range)")
        header = json.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise CacheFileError(f"cannot read: {e}") from e
    except ValueError as e:
        raise CacheFileError(f"header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise CacheFileError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if meta.get("format") != FORMAT:
        raise CacheFileError(f"not a {FORMAT} file")
    if meta.get("version") != str(FORMAT_VERSION):
        raise CacheFileError(f"format version {meta.get('version')}, this tqpipe reads {FORMAT_VERSION}")
    try:
        ends = [int(t["data_offsets"][1]) for t in header.values()]
    except (TypeError, KeyError, IndexError, ValueError) as e:
        raise CacheFileError(f"tensor entries malformed: {e}") from e
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        raise CacheFileError(f"{size} bytes, header describes {expected} (truncated or appended to)")
    return meta, size, header, 8 + n


_CRC_BLOCK = 16 << 20
CRC_THREADS = min(8, os.cpu_count() or 1)
_buffers = threading.local()


def _tensor_spans(entries: dict, start: int, crcs: dict) -> list[tuple[str, int, int, int]]:
    """(name, file offset, length, stored CRC-32) of every tensor."""
    if set(entries) != set(crcs):
        raise CacheFileError("tensor list does not match the checksum list")
    try:
        return [(name, start + int(t["data_offsets"][0]), int(t["data_offsets"][1]) - int(t["data_offsets"][0]),
                 int(crcs[name])) for name, t in entries.items()]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CacheFileError(f"tensor entries malformed: {type(e).__name__}: {e}") from e


def _check_tensor(fd: int, name: str, offset: int, left: int, crc_stored: int) -> None:
    """CRC-32 of one tensor's bytes on the file, read in blocks into this
    thread's buffer (``pread`` and ``zlib.crc32`` release the GIL)."""
    buf = getattr(_buffers, "view", None)
    if buf is None:
        buf = _buffers.view = memoryview(bytearray(_CRC_BLOCK))
    crc = 0
    while left:
        n = os.preadv(fd, [buf[: min(left, _CRC_BLOCK)]], offset)
        if not n:
            raise CacheFileError(f"tensor {name!r} is cut short")
        crc = zlib.crc32(buf[:n], crc)
        offset, left = offset + n, left - n
    if crc != crc_stored:
        raise CacheFileError(f"checksum mismatch in tensor {name!r}")


class _Replaced(Exception):
    """The path was renamed over while it was read (by a writer of the same key)."""


READ_ATTEMPTS = 3  # a writer renaming a new file in mid-read costs a retry, not a miss


def _handle_path(fd: int) -> str | None:
    """A path that opens the file behind ``fd`` itself (``/proc/self/fd`` on
    Linux, ``/dev/fd`` on macOS), whatever is renamed over its name since;
    None where the system has neither."""
    for base in ("/proc/self/fd", "/dev/fd"):
        candidate = f"{base}/{fd}"
        if os.path.exists(candidate):
            return candidate
    return None


def read(path: Path, *, key: dict | None = None) -> CacheFile:
    """Load and verify a cache file; ``key`` (if given) must equal the stored one.

    All tensor bytes are checksummed (on the bytes on disk) and loaded here,
    so a file that passes is entirely in memory and a later eviction or
    rewrite of ``path`` cannot reach the returned caches.  Every byte comes
    from the one file opened first, even while writers of the same key
    rename new files over ``path``; only where the system cannot name an
    open file is ``path`` reopened, and then a file renamed in mid-read is
    read again.
    """
    for _ in range(READ_ATTEMPTS):
        try:
            return _read_once(path, key)
        except _Replaced:
            continue
    raise CacheFileError(f"replaced while it was read, {READ_ATTEMPTS} times")


LOAD_STREAMS = 4  # CPU streams (one thread each) that load a file's tensors side by side


@lru_cache(maxsize=1)
def _load_streams() -> tuple:
    """``mx.cpu`` and ``LOAD_STREAMS - 1`` more CPU streams, made once per process."""
    return (mx.cpu,) + tuple(mx.new_stream(mx.cpu) for _ in range(LOAD_STREAMS - 1))


def deal_by_size(sizes: dict[str, int], groups: int) -> list[list[str]]:
    """Names split into ``groups`` lists of near-equal total size (largest
    first, each to the lightest group): the loading threads finish together."""
    out: list[list[str]] = [[] for _ in range(groups)]
    load = [0] * groups
    for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
        g = load.index(min(load))
        out[g].append(name)
        load[g] += sizes[name]
    return out


def _load_parallel(source: str, spans: list[tuple[str, int, int, int]]) -> dict[str, mx.array]:
    """Every tensor of the file (``spans``: :func:`_tensor_spans`), loaded
    into MLX buffers on ``LOAD_STREAMS`` CPU streams at once and evaluated.

    ``mx.load`` is lazy: each call parses the header, and a tensor's bytes
    are read when it is evaluated, on the stream it was loaded on; so each
    stream evaluates one share of the tensors.  On CUDA one stream filled
    managed memory at ~6 GB/s (0.17 s for a 32k-token 8B-shape cache).
    """
    sizes = {name: length for name, _, length, _ in spans}
    streams = _load_streams()
    shares = [share for share in deal_by_size(sizes, len(streams)) if share]
    arrays: dict[str, mx.array] = {}
    for stream, share in zip(streams, shares):
        loaded = mx.load(source, format="safetensors", stream=stream)
        if set(loaded) != set(sizes):
            raise CacheFileError("the loaded tensors are not the ones the header lists")
        arrays.update((name, loaded[name]) for name in share)
    mx.eval(list(arrays.values()))
    return arrays


# safetensors dtype names (as mx.save_safetensors writes them) -> MLX dtypes
_DTYPES = {"BOOL": mx.bool_, "U8": mx.uint8, "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16,
           "U32": mx.uint32, "I32": mx.int32, "U64": mx.uint64, "I64": mx.int64,
           "F16": mx.float16, "BF16": mx.bfloat16, "F32": mx.float32}


def _upload(fd: int, entries: dict, spans: list) -> dict[str, mx.array] | None:
    """The tensors (``spans``: :func:`_tensor_spans`) read once, checksummed
    and copied into GPU memory (:func:`gpu_upload.read_tensors`); None where
    the driver refuses (the caller loads the plain way).  Every byte comes
    from the open handle."""
    specs = []
    try:
        for name, offset, length, _ in spans:
            t = entries[name]
            dtype = _DTYPES.get(t.get("dtype"))
            if dtype is None:
                log.info("a tensor of dtype %s: loading the plain way", t.get("dtype"))
                return None
            specs.append(gpu_upload.TensorSpan(name, offset, length, dtype, tuple(int(n) for n in t["shape"])))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CacheFileError(f"tensor entries malformed: {type(e).__name__}: {e}") from e
    try:
        arrays, got = gpu_upload.read_tensors(fd, specs)
    except gpu_upload.Unavailable as e:
        log.info("GPU upload refused (%s): loading the plain way", e)
        return None
    except EOFError as e:
        raise CacheFileError(str(e)) from e
    for name, _, _, crc in spans:
        if got[name] != crc:
            raise CacheFileError(f"checksum mismatch in tensor {name!r}")
    return arrays


def _load_checked(f: Any, path: Path, spans: list) -> dict[str, mx.array]:
    """``mx.load`` on CPU streams into MLX buffers while threads checksum
    the same tensors on the file (CUDA: managed memory, for the caller to
    move to the GPU).

    Checksumming the loaded arrays instead would serialise the two passes.
    ``mx.load`` opens the handle's own file (:func:`_handle_path`); without
    such a path it opens ``path``, and as files are only ever replaced whole
    (renamed), every byte came from the handle's file if the path still
    names it after the load; otherwise :class:`_Replaced`.
    """
    with ThreadPoolExecutor(CRC_THREADS) as pool:
        checks = [pool.submit(_check_tensor, f.fileno(), *span) for span in spans]
        try:
            # on CPU streams: on CUDA, mx.load on the GPU stream is 3x
            # slower (H100, 3.9 GB: 2.3 s against 0.40 s + 0.36 s for the
            # GPU's first touch by page faults)
            via = _handle_path(f.fileno())
            arrays = _load_parallel(via or str(path), spans)
        finally:
            for check in checks:  # a damaged file's own error before MLX's
                check.result()
    if via is None and os.stat(path).st_ino != os.fstat(f.fileno()).st_ino:
        raise _Replaced()
    return arrays


def _read_once(path: Path, key: dict | None) -> CacheFile:
    """One :func:`read`: the header through one open handle, then the
    tensors, checked against their CRC-32s: on CUDA straight into GPU memory
    through page-locked staging buffers (:func:`_upload`); elsewhere, or
    where the driver refuses, by ``mx.load`` (:func:`_load_checked`).
    """
    try:
        with open(path, "rb") as f:
            meta, _, entries, start = _parse_header(f)
            stored_key, info, ids, leaves, crcs = _metadata(meta)
            if key is not None and stored_key != key:
                diff = sorted(k for k in set(key) | set(stored_key) if key.get(k) != stored_key.get(k))
                raise CacheFileError(f"computed from something else (differs in: {', '.join(diff)})")
            table = _class_table(_names_vlm(ids))
            unknown = [c for c in ids if c not in table]
            if unknown:
                raise CacheFileError(f"unknown cache classes {unknown}")
            spans = _tensor_spans(entries, start, crcs)
            arrays = _upload(f.fileno(), entries, spans) if gpu_upload.available() else None
            on_gpu = arrays is not None
            if arrays is None:
                arrays = _load_checked(f, path, spans)
    except OSError as e:
        raise CacheFileError(f"cannot read tensors: {e}") from e
    except (RuntimeError, ValueError) as e:
        raise CacheFileError(f"cannot load tensors: {e}") from e
    if "prefix_ids" not in arrays:
        raise CacheFileError("no prefix_ids tensor")
    prefix = arrays.pop("prefix_ids")
    if not on_gpu:
        on_gpu = gpu_upload.to_gpu(arrays.values())  # the GPU's first touch, in bulk (CUDA)
    flat = [(name[len("kv."):], a) for name, a in arrays.items()] + [(p, v) for p, v in leaves]
    try:
        states = tree_unflatten(flat)
        if not isinstance(states, list) or len(states) != len(ids):
            raise CacheFileError(f"{len(ids)} layers listed, states for {len(states)}")
        try:
            metas = json.loads(meta.get("meta_state", "{}"))
        except ValueError as e:
            raise CacheFileError(f"meta_state is not JSON: {e}") from e
        caches = [table[cid].from_state(s, metas.get(str(i))) if cid in _META_STATE else table[cid].from_state(s)
                  for i, (cid, s) in enumerate(zip(ids, states))]
    except CacheFileError:
        raise
    except (TypeError, ValueError, KeyError, IndexError) as e:
        raise CacheFileError(f"cannot rebuild the caches: {type(e).__name__}: {e}") from e
    return CacheFile(caches=caches, prefix_ids=prefix.tolist(), key=stored_key, info=info, on_gpu=on_gpu)


def _metadata(meta: dict) -> tuple[dict, dict, list, list, dict]:
    """``(key, info, layer class ids, non-array leaves, CRC-32s)`` of a header's metadata."""
    try:
        return (json.loads(meta["key"]), json.loads(meta["info"]), json.loads(meta["layers"]),
                json.loads(meta["leaves"]), json.loads(meta["crc32"]))
    except (KeyError, ValueError) as e:
        raise CacheFileError(f"metadata incomplete: {e}") from e
