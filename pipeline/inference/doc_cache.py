"""The document-cache store: prefilled KV caches on disk, keyed by what made them.

A long document's prefill is the expensive part of a run; every later run
that asks about the same document (one more task, a rerun after a crash, a
renamed copy in the inbox, ``tqpipe ask``) can start from the stored cache
instead.  One entry is one file (``kv_file``), named
``<content hash, 16 hex>-<key digest>``, so the entries of one document are
found by its content hash alone, before the document is read.  The key:

* the document's **content hash** (not its path: a renamed copy hits),
* the **page selection** and the **reading settings** that shape the prompt
  (image mode, dpi, page markers, whether the model reads images),
* the **reader**: a digest of the code and library versions that turn a file
  into prompt tokens (PDF text extraction, OCR, chat templates), so an
  upgrade that would read the file differently is a different entry,
* the **model identity** (name, config, a fingerprint of every file in the
  model folder: weights, tokenizer, chat template; device, dtype, MLX) and
  the **cache config** (scheme, bits, window, quantizer, prefill chunk: the
  chunking decides when the centring means are taken),
* the file **format version**.

The context limit and the tasks are not in the key: they only decide
whether the document is cut short.  An entry records its prompt's token ids
and whether it was cut; a hit without reading the document
(:func:`pipeline.run.document.process_document`) is taken only for an entry
that was not cut, had no skipped pages and still fits the caller's budget,
and a caller that did read the document compares token ids (a difference
makes the entry a miss, replaced by the new prefill).

The whole key is stored in the file as well and compared on load: a file
copied under another name, a digest collision or a file written by another
model is a miss with a warning, never a wrong cache.  So is a truncated or
corrupt file (size check against the header, CRC-32 of every tensor); such a
file is deleted.

Size cap: after each save the least recently used entries are deleted until
the store fits ``max_bytes``; a hit refreshes its entry's modification time,
which is the LRU clock (access times are unreliable on ``noatime`` mounts).

Concurrency (Ray workers, several runs, a shared filesystem): writes are
atomic renames of complete files, so readers and concurrent writers of one
key never see a partial file; no lock is taken.  A reader loads the whole
file before using it, so an eviction racing a load at worst makes it a miss.
A writer killed mid-save leaves a hidden temporary file, which is invisible
to lookups and listings and removed by ``prune`` once it is an hour old.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from pipeline.inference import kv_file
from pipeline.inference.kv_file import FORMAT_VERSION, SUFFIX, TEMP_MARK, CacheFileError, UnsupportedCache
from pipeline.models.store import tqpipe_home

log = logging.getLogger(__name__)

DEFAULT_MAX_GB = 20.0
STALE_TEMP_S = 3600.0  # a temporary file this old belongs to a dead writer
_GB = 1024**3


def default_store_path() -> Path:
    """Where document caches live unless a job's ``cache_store.path`` says otherwise."""
    return tqpipe_home() / "doc-caches"


def store_for_job(job: Any) -> "DocCacheStore | None":
    """The store a job's ``cache_store`` block names (None when ``max_gb`` is 0);
    a relative path is relative to the job file's folder."""
    spec = job.spec.cache_store
    if spec.max_gb <= 0:
        return None
    return DocCacheStore.from_gb(job.resolve(spec.path) if spec.path else None, spec.max_gb)


@dataclass(frozen=True)
class DocKey:
    """What a document cache was computed from; equal keys give bit-equal caches."""

    content_hash: str
    pages: Any  # the page selection as given (None: every page)
    model: dict  # model identity
    cache: dict  # cache config
    context: dict  # the reading settings that shape the prompt
    reader: str = ""  # reader_fingerprint()
    version: int = FORMAT_VERSION

    def fields(self) -> dict:
        """The key as plain JSON data (stored in the file and compared on load)."""
        return json.loads(json.dumps({
            "content_hash": self.content_hash, "pages": self.pages, "model": self.model,
            "cache": self.cache, "context": self.context, "reader": self.reader, "version": self.version,
        }, sort_keys=True))

    def digest(self) -> str:
        """The entry's file stem: 32 hex digits of SHA-256 over the canonical key."""
        canon = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:32]


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def files_fingerprint(model_dir: Path | None) -> str | None:
    """Digest of the names, sizes and modification times of every file in the
    model folder (weights, tokenizer, chat template, processor config).

    Cheap (no file is read) and it changes whenever a file is replaced; Hub
    snapshots resolve to blobs named by their content hash.
    """
    if model_dir is None:
        return None
    files = []
    for p in sorted(Path(model_dir).iterdir()) if Path(model_dir).is_dir() else []:
        if p.name.startswith("."):
            continue
        try:
            real = p.resolve()
            if not real.is_file():
                continue
            st = real.stat()
        except OSError:
            continue
        files.append([p.name, real.name, st.st_size, st.st_mtime_ns])
    return _digest(files)


# What turns a file into prompt tokens, besides the model: the reading and
# prompt modules (relative to the ``pipeline`` package) and the libraries they call.
READER_MODULES = ("inputs/document.py", "inputs/ingest.py", "inputs/pdf.py", "inputs/images.py",
                  "inputs/ocr.py", "inference/prompt.py", "schema/pages.py")
READER_PACKAGES = ("pymupdf", "rapidocr", "onnxruntime", "pillow", "transformers", "tokenizers",
                   "mlx-lm", "mlx-vlm")


@lru_cache(maxsize=1)
def reader_fingerprint() -> str:
    """Digest of the reading code and the versions of the libraries it calls.

    Part of the key because a stored cache may be used without reading the
    document again: a tqpipe or library upgrade that could extract, OCR or
    template the file differently must not be answered from an old reading.
    """
    from importlib import metadata

    import pipeline

    h = hashlib.sha256()
    root = Path(pipeline.__file__).parent
    for rel in READER_MODULES:
        h.update(rel.encode() + b"\0")
        try:
            h.update((root / rel).read_bytes())
        except OSError:
            h.update(b"missing")
    for dist in READER_PACKAGES:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "-"
        h.update(f"\0{dist}={version}".encode())
    return h.hexdigest()[:16]


def model_identity(name: str, config: dict | None, model: Any = None, model_dir: Path | None = None) -> dict:
    """What makes two models' caches interchangeable: the same name, config and
    model files, on the same kind of device, in the same dtype, under the same MLX."""
    import mlx.core as mx

    dtype = None
    if model is not None:
        from mlx.utils import tree_flatten

        dtype = next((str(p.dtype) for _, p in tree_flatten(model.parameters())
                      if mx.issubdtype(p.dtype, mx.floating)), None)
    return {"name": name, "config": _digest(config or {}), "files": files_fingerprint(model_dir),
            "device": mx.default_device().type.name, "dtype": dtype, "mlx": mx.__version__}


CACHE_KEY_FIELDS = ("kv_quant_scheme", "kv_bits", "key_bits", "value_bits", "window", "quantizer", "prefill_chunk")
CONTEXT_KEY_FIELDS = ("images", "dpi", "page_markers")  # what a successful reading depends on besides the file


def document_key(content_hash: str, context: Any, model: dict, cache: Any, *, reads_images: bool) -> DocKey:
    """The store key of one document's prefilled cache.

    ``context`` and ``cache`` are the job's specs (pydantic models or dicts);
    ``reads_images`` whether the model takes page images (it decides whether
    scanned pages become images or OCR'd text).  The prefill chunk is in: it
    decides which tokens the TurboQuant centring means are taken over.
    """
    ctx = context.model_dump(mode="json") if hasattr(context, "model_dump") else dict(context)
    spec = cache.model_dump(mode="json") if hasattr(cache, "model_dump") else dict(cache)
    return DocKey(
        content_hash=content_hash,
        pages=ctx.get("pages"),
        model=model,
        cache={k: spec.get(k) for k in CACHE_KEY_FIELDS},
        context={**{k: ctx.get(k) for k in CONTEXT_KEY_FIELDS}, "reads_images": bool(reads_images)},
        reader=reader_fingerprint(),
    )


def content_stem(content_hash: str) -> str:
    """The first 16 hex digits of a content hash: the prefix of its entries' names."""
    return re.sub(r"[^0-9a-f]", "", content_hash.split(":", 1)[-1].lower())[:16] or "0"


@dataclass
class Hit:
    """A loaded entry: the rebuilt per-layer caches and what the engine needs."""

    caches: list
    prefix_ids: list[int]  # the stored prompt prefix
    info: dict
    load_s: float
    nbytes: int  # file size
    path: Path


@dataclass
class Entry:
    """One stored cache, as listed (read from the file header only)."""

    name: str  # the key digest
    path: Path
    nbytes: int
    last_used: float  # epoch seconds (the file's mtime)
    info: dict
    key: dict
    error: str | None = None  # set when the file is unusable


def _is_temp(p: Path) -> bool:
    return p.name.startswith(".") and TEMP_MARK in p.name


# The names path_for gives: content stem, "-", key digest.  Only files so
# named are the store's: a store folder may hold anything else (a model's
# weights are .safetensors too), and those are never listed, evicted or removed.
_ENTRY_NAME = re.compile(r"^[0-9a-f]{1,16}-[0-9a-f]{32}" + re.escape(SUFFIX) + "$")


def _is_entry(p: Path) -> bool:
    return bool(_ENTRY_NAME.match(p.name))


class DocCacheStore:
    """Document caches under ``root``, at most ``max_bytes`` in total (LRU eviction)."""

    def __init__(self, root: Path | str | None = None, max_bytes: int | None = None):
        self.root = Path(root).expanduser() if root is not None else default_store_path()
        self.max_bytes = int(DEFAULT_MAX_GB * _GB) if max_bytes is None else int(max_bytes)

    @classmethod
    def from_gb(cls, root: Path | str | None, max_gb: float | None) -> "DocCacheStore":
        return cls(root, None if max_gb is None else int(max_gb * _GB))

    def path_for(self, key: DocKey) -> Path:
        return self.root / f"{content_stem(key.content_hash)}-{key.digest()}{SUFFIX}"

    def candidates(self, content_hash: str) -> list[Entry]:
        """The readable entries stored for a document's content (headers only;
        no model needed), most recently used first."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.glob(f"{content_stem(content_hash)}-*{SUFFIX}"):
            entry = _entry(p) if _is_entry(p) else None
            if entry is not None and entry.error is None and entry.key.get("content_hash") == content_hash:
                out.append(entry)
        return sorted(out, key=lambda e: (-e.last_used, e.name))

    # -- lookup / save ------------------------------------------------------
    def load(self, key: DocKey, prefix_ids: list[int] | None = None) -> Hit | None:
        """The stored cache for ``key``, or None: absent; unusable (warned and
        deleted); or, when the caller read the document and passes its
        ``prefix_ids``, stored for another prompt (the document was cut to
        another budget: deleted, so the caller's prefill replaces it)."""
        path = self.path_for(key)
        if not path.is_file():
            return None
        t0 = time.perf_counter()
        try:
            loaded = kv_file.read(path, key=key.fields())
        except Exception as e:  # a cache only saves time: whatever is wrong with it, prefill instead
            self.discard(key, f"{e}" if isinstance(e, CacheFileError) else f"{type(e).__name__}: {e}")
            return None
        if prefix_ids is not None and loaded.prefix_ids != list(prefix_ids):
            log.info("document cache %s holds another cut of this document (%d tokens, now %d); replacing it",
                     path.name, len(loaded.prefix_ids), len(prefix_ids))
            _unlink(path)
            return None
        load_s = time.perf_counter() - t0
        try:
            os.utime(path)  # the LRU clock
        except OSError:
            pass
        return Hit(caches=loaded.caches, prefix_ids=loaded.prefix_ids, info=loaded.info, load_s=load_s,
                   nbytes=path.stat().st_size if path.exists() else 0, path=path)

    def discard(self, key: DocKey, reason: str) -> None:
        """Warn that ``key``'s entry is unusable and delete it (the next save replaces it)."""
        path = self.path_for(key)
        log.warning("document cache %s is unusable, prefilling instead: %s", path, reason)
        _unlink(path)

    def contains(self, key: DocKey) -> bool:
        """Whether a complete entry of ``key``'s format is present (header check only)."""
        path = self.path_for(key)
        try:
            meta, _ = kv_file.read_header(path)
            return json.loads(meta.get("key", "null")) == key.fields()
        except (CacheFileError, ValueError):
            return False

    def save(self, key: DocKey, caches: list, prefix_ids: list[int], info: dict) -> Path | None:
        """Store a freshly prefilled cache, then evict down to the cap.

        Returns the entry's path, or None when nothing was stored (a cache
        class the format does not hold, a cache larger than the whole cap,
        or a write error: all logged, none fatal: the run goes on without).
        An entry already present for ``key`` is kept as it is.
        """
        path = self.path_for(key)
        if self.contains(key):
            return path
        try:
            nbytes = kv_file.write(path, caches, prefix_ids, key=key.fields(), info=info)
        except UnsupportedCache as e:
            log.info("document cache not stored: layer cache %s is not storable", e)
            return None
        except Exception as e:  # a full disk, a read-only mount...: the run goes on without
            log.warning("document cache not stored in %s: %s: %s", self.root, type(e).__name__, e)
            return None
        if nbytes > self.max_bytes:
            log.warning("document cache %s (%.1f MiB) exceeds the store's cap (%.1f MiB); removed",
                        path.name, nbytes / 2**20, self.max_bytes / 2**20)
            _unlink(path)
            return None
        self.evict(keep=path)
        return path

    # -- listing / removal ----------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every stored entry, least recently used first (temporary files and
        files the store did not name excluded)."""
        out = []
        if not self.root.is_dir():
            return out
        for p in self.root.glob(f"*{SUFFIX}"):
            if _is_entry(p):
                entry = _entry(p)
                if entry is not None:
                    out.append(entry)
        out.sort(key=lambda e: (e.last_used, e.name))
        return out

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries())

    def remove(self, names: Iterable[str]) -> list[str]:
        """Delete the entries whose names start with one of ``names``; returns those removed."""
        prefixes = [n for n in names if n]
        gone = []
        for e in self.entries():
            if any(e.name.startswith(n) for n in prefixes) and _unlink(e.path):
                gone.append(e.name)
        return gone

    def evict(self, max_bytes: int | None = None, *, keep: Path | None = None) -> list[str]:
        """Delete least recently used entries until the store fits ``max_bytes``
        (default: the cap); unusable files go first.  ``keep`` is never evicted."""
        cap = self.max_bytes if max_bytes is None else int(max_bytes)
        entries = self.entries()
        entries.sort(key=lambda e: (e.error is None, e.last_used, e.name))
        total = sum(e.nbytes for e in entries)
        gone = []
        for e in entries:
            if total <= cap and e.error is None:
                break
            if keep is not None and e.path == keep:
                continue
            if _unlink(e.path):
                gone.append(e.name)
            total -= e.nbytes
        return gone

    def prune(self, max_bytes: int | None = None, *, older_than_s: float | None = None) -> list[str]:
        """``evict`` to ``max_bytes``, drop entries unused for ``older_than_s``,
        and remove temporary files of writers that died (older than an hour)."""
        now = time.time()
        gone = []
        if older_than_s is not None:
            for e in self.entries():
                if now - e.last_used > older_than_s and _unlink(e.path):
                    gone.append(e.name)
        gone += self.evict(max_bytes)
        if self.root.is_dir():
            for p in self.root.iterdir():
                try:
                    if _is_temp(p) and now - p.stat().st_mtime > STALE_TEMP_S and _unlink(p):
                        gone.append(p.name)
                except OSError:
                    continue
        return gone


def _entry(p: Path) -> Entry | None:
    """The listing of one entry file (None if it vanished); an unreadable
    header gives an entry with ``error`` set."""
    try:
        st = p.stat()
    except OSError:
        return None
    info, key, error = {}, {}, None
    try:
        meta, _ = kv_file.read_header(p)
        info, key = json.loads(meta.get("info", "{}")), json.loads(meta.get("key", "{}"))
    except (CacheFileError, ValueError) as e:
        error = str(e)
    return Entry(name=p.name[: -len(SUFFIX)], path=p, nbytes=st.st_size, last_used=st.st_mtime,
                 info=info, key=key, error=error)


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("cannot remove %s: %s", path, e)
        return False
