"""The results file: an append-only JSONL log that doubles as the checkpoint.

Why one file and no separate progress database: the results ARE the
progress.  A record is appended (and fsynced) as soon as a task finishes, so
a rerun only has to read the file to know which keys are done, and there is
no second file that could disagree with it.

Durability rules, all enforced here:

- A record is written with ONE ``os.write`` of the whole line on an
  ``O_APPEND`` descriptor, then ``fsync``.  A ``kill -9`` can therefore leave
  at most one torn line, at the end.
- ``open()`` repairs such a torn tail: the bytes are moved to
  ``<path>.torn-<timestamp>`` (never silently dropped) and the file is cut
  back to its last complete line.  A tail that is a complete record whose
  newline never made it is kept and given its newline.
- If a write fails (ENOSPC, EIO, quota), the file is truncated back to its
  size before the write and a :class:`CheckpointError` naming the file is
  raised, so a half-written line never remains to be glued to the next one.

Only one process may append to a results file at a time; the runner holds a
:class:`pipeline.output.lock.JobLock` for that.  Readers (``summarize``,
``iter_records``) never modify the file and are safe while a run appends.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

from pipeline.errors import CheckpointError
from pipeline.schema.paths import json_safe, path_from_b64, shown
from pipeline.schema.record import json_default

logger = logging.getLogger(__name__)

_DUMP_OPTIONS = orjson.OPT_NON_STR_KEYS  # page numbers as dict keys
_TAIL_BLOCK = 1 << 16
#: A key whose error records are transient (I/O, memory: ``error.transient``)
#: is retried by a plain rerun until it has this many error records; after
#: that only ``--retry-failed`` runs it again.
TRANSIENT_ATTEMPTS = 3


def dumps_line(record: dict) -> bytes:
    """One record as one JSON line.  orjson escapes newlines inside strings,
    so the only b"\\n" is the terminator.  A string that is not valid UTF-8
    (an undecodable file name inside a message) is written with ``\\xNN``
    escapes rather than failing the record (:mod:`pipeline.schema.paths`)."""
    try:
        return orjson.dumps(record, default=json_default, option=_DUMP_OPTIONS) + b"\n"
    except orjson.JSONEncodeError:
        return orjson.dumps(json_safe(record), default=json_default, option=_DUMP_OPTIONS) + b"\n"


def _fsync_dir(path: Path) -> None:
    """Make a newly created file's directory entry durable (POSIX needs it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and all of Windows) refuse fsync on a directory
    finally:
        os.close(fd)


def _last_newline_end(f, size: int) -> int:
    """Offset just past the last b"\\n" in the file (0 if none), scanning
    backwards in blocks so a multi-GB results file is not read whole."""
    pos = size
    while pos > 0:
        start = max(0, pos - _TAIL_BLOCK)
        f.seek(start)
        block = f.read(pos - start)
        i = block.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


def _parse_line(line: bytes) -> dict | None:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("key"), str):
        return obj
    return None


def iter_records(path: Path) -> Iterator[dict]:
    """Every intact record in ``path``, in file order, without modifying it.

    A torn last line (a run in progress or a crash) and lines that are not
    records are skipped with a warning (naming file and line number), so
    they are recomputed rather than trusted.
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                logger.debug("%s: line %d is incomplete (torn or being written); ignored", path, lineno)
                break
            if not line.strip():
                continue
            record = _parse_line(line)
            if record is None:
                logger.warning("%s: line %d is not a valid record; ignored (it will be recomputed)", path, lineno)
                continue
            yield record


class KeyIndex:
    """What the results file says about each key: ok (and warned), or failed
    (how often, transient or not).  Shared by :class:`ResultLog` (the skip
    rule) and :func:`summarize` (``tqpipe status``), so both count alike."""

    def __init__(self) -> None:
        self._status: dict[str, str] = {}  # key -> "ok" once any ok record exists, else "error"
        self._latest_ok_warnings: dict[str, tuple[str, ...]] = {}  # key -> warnings of its latest ok record
        self._errors: dict[str, tuple[int, bool]] = {}  # failed key -> (error records, last one transient)
        self._sources: dict[str, tuple[str, str | None]] = {}  # key -> (source, source_b64) of its last record
        self._last: dict[str, int] = {}  # key -> position of its last record in the file
        self._seen = 0

    def note(self, record: dict) -> None:
        """Account for one record, in file order."""
        key, status = record["key"], record.get("status")
        self._seen += 1
        self._last[key] = self._seen
        if isinstance(record.get("source"), str):
            self._sources[key] = (record["source"], record.get("source_b64"))
        if status == "ok":
            self._status[key] = "ok"
            self._latest_ok_warnings[key] = tuple(record.get("warnings") or ())
        elif self._status.get(key) != "ok":
            self._status[key] = "error"
            n, _ = self._errors.get(key, (0, False))
            error = record.get("error")
            self._errors[key] = (n + 1, isinstance(error, dict) and bool(error.get("transient")))

    def latest_per_name(self, keys: set[str]) -> set[str]:
        """Of ``keys``, the one recorded last for each (source, task and
        config): what a watched inbox means by a file's result.  A
        half-copied file that failed and was then processed whole, or an
        image folder that grew, leaves records under an older content hash
        that its newer result supersedes."""
        latest: dict[tuple, str] = {}
        for key in keys:
            name = (self._sources.get(key), key.split("/", 1)[-1])
            held = latest.get(name)
            if held is None or self._last.get(key, 0) > self._last.get(held, 0):
                latest[name] = key
        return set(latest.values())

    def is_done(self, key: str, *, include_failed: bool = True) -> bool:
        """True if ``key`` has an ok record, or an error record and
        ``include_failed`` (pass False to retry failed ones).  A transient
        error (I/O, memory) with fewer than :data:`TRANSIENT_ATTEMPTS` error
        records is never done: a plain rerun retries it."""
        status = self._status.get(key)
        return status == "ok" or (status == "error" and include_failed and not self.retryable(key))

    def retryable(self, key: str) -> bool:
        """True for a failed key whose last error was transient and that has attempts left."""
        n, transient = self._errors.get(key, (0, False))
        return self._status.get(key) == "error" and transient and n < TRANSIENT_ATTEMPTS

    def source(self, key: str) -> Path | None:
        """The file ``key``'s last record was made from (its raw bytes when recorded), or None."""
        found = self._sources.get(key)
        if found is None:
            return None
        text, raw = found
        return path_from_b64(raw) if raw else Path(text)

    def warnings(self, key: str) -> tuple[str, ...]:
        """The quality warnings of ``key``'s counting ok record (empty if none, or not ok)."""
        return self._latest_ok_warnings.get(key, ()) if self._status.get(key) == "ok" else ()

    @property
    def done_keys(self) -> set[str]:
        return {k for k, s in self._status.items() if s == "ok"}

    @property
    def failed_keys(self) -> set[str]:
        """Keys whose every record is an error (a later ok record clears it)."""
        return {k for k, s in self._status.items() if s != "ok"}


class ResultLog:
    """Append-only JSONL results with durable appends and a done-key index.

    Use under the job lock::

        with JobLock(out), ResultLog(out) as log:
            if not log.is_done(key):
                log.append(make_record(...))
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"{shown(self.path.parent)}: cannot create the results folder: {e.strerror or e}") from e
        self._fd: int | None = None
        self.index = KeyIndex()
        self._broken: str | None = None

    # -- lifecycle -------------------------------------------------------
    def open(self) -> "ResultLog":
        """Repair a torn tail, index the done keys, open for appending."""
        if self._fd is not None:
            return self
        created = not self.path.exists()
        self._repair_tail()
        self.index = KeyIndex()
        for record in iter_records(self.path):
            self._note(record)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open results file for appending: {e.strerror or e}") from e
        if created:
            _fsync_dir(self.path.parent)
        logger.debug("%s: %d done, %d failed keys", self.path, len(self.done_keys), len(self.failed_keys))
        return self

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "ResultLog":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- repair ----------------------------------------------------------
    def _repair_tail(self) -> None:
        try:
            f = open(self.path, "r+b")
        except FileNotFoundError:
            return
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open results file: {e.strerror or e}") from e
        with f:
            size = os.fstat(f.fileno()).st_size
            end = _last_newline_end(f, size)
            if end == size:
                return
            f.seek(end)
            tail = f.read(size - end)
            if _parse_line(tail) is not None:
                # The record is complete; only its newline was lost.  Keep it.
                f.seek(size)
                f.write(b"\n")
                f.flush()
                os.fsync(f.fileno())
                logger.warning("%s: last record had no newline; completed it", self.path)
                return
            torn = self._torn_path()
            try:
                with open(torn, "xb") as t:
                    t.write(tail)
                    t.flush()
                    os.fsync(t.fileno())
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                # Never cut the tail without a saved copy; never append after it either.
                if torn.exists() and f.seek(0, os.SEEK_END) == size:
                    torn.unlink(missing_ok=True)
                raise CheckpointError(
                    f"{self.path}: has a torn last line ({len(tail)} bytes) that could not be moved to"
                    f" {torn}: {e.strerror or e}; free space and rerun"
                ) from e
            logger.warning(
                "%s: removed a torn last line (%d bytes, from an interrupted run) and saved it to %s;"
                " that record will be recomputed",
                self.path, len(tail), torn,
            )

    def _torn_path(self) -> Path:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        candidate = self.path.with_name(f"{self.path.name}.torn-{stamp}")
        n = 1
        while candidate.exists():
            candidate = self.path.with_name(f"{self.path.name}.torn-{stamp}-{n}")
            n += 1
        return candidate

    # -- writing ---------------------------------------------------------
    def append(self, record: dict) -> None:
        """Durably append one record: whole line, one write, fsync.

        On failure the file is cut back to its previous size and a
        CheckpointError naming the file is raised; the caller may retry
        after freeing space.  Nothing is recorded as done unless the write
        and fsync succeeded.
        """
        if self._fd is None:
            raise CheckpointError(f"{self.path}: ResultLog.append() before open()")
        if self._broken:
            raise CheckpointError(self._broken)
        key = record.get("key")
        if not isinstance(key, str):
            raise CheckpointError(f"{self.path}: record has no 'key' string; refusing to write it")
        try:
            line = dumps_line(record)
        except (TypeError, orjson.JSONEncodeError) as e:
            raise CheckpointError(
                f"{self.path}: record {key} of {shown(record.get('source', '?'))} cannot be serialized: {e}") from e
        fd = self._fd
        self._check_same_file(key, written=False)
        before = os.fstat(fd).st_size
        try:
            view = memoryview(line)
            while view:  # a short write (no error) is continued, not left torn
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        except BaseException as e:  # also Ctrl-C between a short write and its rest
            self._rollback(before, e)
            if not isinstance(e, OSError):
                raise
            raise CheckpointError(
                f"{self.path}: could not write record {key}: {e.strerror or e};"
                f" the file was restored to its previous {before} bytes"
            ) from e
        self._check_same_file(key, written=True)
        self._note(record)

    def _check_same_file(self, key: str, *, written: bool) -> None:
        """The path must still name the file this run appends to: an editor's
        save (write a copy, rename it over) or a ``mv`` would send every
        later record to an unlinked file while the run reported success."""
        held = os.fstat(self._fd)
        try:
            now = os.stat(self.path)
            same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
        except OSError:
            same = False
        if not same:
            self._broken = (f"{self.path} was replaced or removed while this run appended to it"
                            f"{f'; record {key} went to the old file' if written else ''}; "
                            "a plain rerun redoes what the file now lacks")
            raise CheckpointError(self._broken)

    def _rollback(self, size: int, cause: BaseException) -> None:
        try:
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        except OSError as e:
            # Further appends would glue onto the partial line; refuse them.
            # The next open() repairs the tail (and keeps the torn bytes).
            self._broken = (
                f"{self.path}: a failed write ({cause}) left a partial line that could"
                f" not be removed ({e.strerror or e}); reopen the file to repair it"
            )

    # -- index -----------------------------------------------------------
    def _note(self, record: dict) -> None:
        self.index.note(record)

    def is_done(self, key: str, *, include_failed: bool = True) -> bool:
        """See :meth:`KeyIndex.is_done`."""
        return self.index.is_done(key, include_failed=include_failed)

    @property
    def done_keys(self) -> set[str]:
        return self.index.done_keys

    @property
    def failed_keys(self) -> set[str]:
        return self.index.failed_keys

    def records(self) -> Iterator[dict]:
        """Every intact record in file order (retried keys appear more than once)."""
        return iter_records(self.path)


def latest_records(path: Path) -> dict[str, dict]:
    """The record that counts for each key: the last ok one, else the last error."""
    latest: dict[str, dict] = {}
    for record in iter_records(path):
        prev = latest.get(record["key"])
        if prev is None or record.get("status") == "ok" or prev.get("status") != "ok":
            latest[record["key"]] = record
    return latest


def read_index(path: Path) -> tuple[KeyIndex, int]:
    """The :class:`KeyIndex` of a results file and its number of records, read-only."""
    index = KeyIndex()
    records = 0
    for record in iter_records(path):
        records += 1
        index.note(record)
    return index, records


def summarize(path: Path, expected_keys: set[str], *, strict: bool = False,
              index: tuple[KeyIndex, int] | None = None) -> dict:
    """Counts for ``tqpipe status``: of ``expected_keys`` (every document x
    task under the current config), how many are done, failed, pending;
    ``warned``: done keys whose record carries quality warnings (per code in
    ``warnings``), ``retryable``: failed keys a plain rerun retries, and
    ``stale``: keys in the file the current job no longer produces (an
    edited task or a removed document).  ``failing`` is what the exit code
    counts: failed, plus warned under ``strict`` - the same rule as
    ``tqpipe run`` (:attr:`pipeline.run.runner.RunSummary.exit_code`).
    ``index`` is :func:`read_index` of ``path`` if the caller has it already.
    Read-only, safe during a run."""
    index, records = index or read_index(path)
    expected = set(expected_keys)
    done_keys, failed_keys = index.done_keys, index.failed_keys
    done = len(expected & done_keys)
    failed = len(expected & failed_keys)
    codes: dict[str, int] = {}
    warned = 0
    for k in expected:
        if found := index.warnings(k):
            warned += 1
            for code in found:
                codes[code] = codes.get(code, 0) + 1
    return {
        "path": str(path),
        "expected": len(expected),
        "done": done,
        "failed": failed,
        "pending": len(expected) - done - failed,
        "warned": warned,
        "warnings": dict(sorted(codes.items())),
        "retryable": sum(1 for k in expected if index.retryable(k)),
        "failing": failed + (warned if strict else 0),
        "stale": len((done_keys | failed_keys) - expected),
        "records": records,
    }
