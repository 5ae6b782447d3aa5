"""Inbox folder watcher: process each new document exactly once.

Files arrive in an inbox by scanner, ``scp`` or a sync client, usually
slowly.  A file is picked up only after its size and mtime have stayed the
same for ``settle_seconds`` of *our* observation (mtime-vs-clock comparisons
break on network mounts with skewed clocks), so a half-copied file is never
read.  Temporary names (``.part``, ``.tmp``, ``.crdownload``, hidden files)
are ignored until they are renamed to their final name.

Where the OS can tell, a settled file is also checked for writers: on Linux
a read lease (``F_SETLEASE``) is refused while any process holds the file
open for writing, so a copy that pauses longer than the settle time is not
read half-written.  Where leases are not available (another owner, NFS,
other systems) the size-and-mtime rule alone decides.

Polling, not inotify, is deliberate: inboxes are often NFS/SMB mounts or
sync folders where inotify events never arrive, and a poll every second over
one folder costs nothing next to running a model.

Exactly once across restarts: every handled file is appended to a ledger
(JSONL through :class:`~pipeline.output.results_log.ResultLog`, so the same atomic
appends and torn-line repair) with its content hash and path.  A restarted
watcher skips ledger entries whose path, size and mtime still match without
rereading them, and skips any file whose content hash is in the ledger, so a
re-copied file with the same bytes is not redone.  Files that failed are
recorded too and are not retried until their content changes.  A second
name for bytes already handled is recorded ``duplicate``; ``same_content``
(if given) is told first, so the caller can write that name's records.
File names are kept as text with undecodable bytes escaped
(:mod:`pipeline.schema.paths`) and quoted in log lines.  The ledger is
an optimisation on top of the results file, not the source of truth: if the
watcher dies between writing results and writing the ledger, the document is
offered again and the runner's checkpoint skips its finished tasks.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from pathlib import Path

from pipeline.errors import CheckpointError, IngestError, LockHeldError, RunError, TqpipeError
from pipeline.inputs.discover import IMAGE_SUFFIXES, PDF_SUFFIXES, DocumentRef, content_hash, natural_key
from pipeline.output.lock import JobLock
from pipeline.output.results_log import ResultLog
from pipeline.schema.paths import path_b64, path_text, shown
from pipeline.schema.record import utc_now

logger = logging.getLogger(__name__)

DEFAULT_PATTERNS: tuple[str, ...] = ("*.pdf", *sorted(f"*{s}" for s in IMAGE_SUFFIXES))
#: Names download tools and copy programs use while a file is incomplete.
TEMP_PATTERNS: tuple[str, ...] = (".*", "~*", "*.part", "*.partial", "*.tmp", "*.temp", "*.crdownload",
                                  "*.download", "*.filepart", "*.!sync", "*.swp")
#: Failures that are not the document's fault: retry later instead of marking it failed.
_TRANSIENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EAGAIN}

Signature = tuple  # (size, mtime_ns) for a file; sorted ((name, size, mtime_ns), ...) for a folder


def _matches(name: str, patterns: Iterable[str]) -> bool:
    lower = name.lower()
    return any(fnmatch.fnmatchcase(lower, p.lower()) for p in patterns)


def _sig_id(sig: Signature) -> str:
    return hashlib.sha1(path_text(repr(sig)).encode()).hexdigest()[:16]


def open_for_writing_elsewhere(path: Path) -> bool:
    """True when some process holds ``path`` open for writing, as far as the OS
    can tell (Linux read leases); False when it cannot tell."""
    import fcntl

    setlease = getattr(fcntl, "F_SETLEASE", None)
    if setlease is None or path.is_dir():
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, setlease, fcntl.F_RDLCK)
    except OSError as e:
        return e.errno in (errno.EAGAIN, errno.EBUSY)  # EACCES (not our file), EINVAL (NFS): cannot tell
    else:
        fcntl.fcntl(fd, setlease, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)


class InboxWatcher:
    """Poll ``inbox`` for settled PDFs, images and image-set folders.

    A top-level file matching ``patterns`` is one document; a top-level
    folder holding images is one image-set document (picked up once no file
    in it has changed for ``settle_seconds``).
    """

    def __init__(
        self,
        inbox: Path,
        ledger_path: Path,
        *,
        settle_seconds: float = 2.0,
        poll_seconds: float = 1.0,
        patterns: Iterable[str] = DEFAULT_PATTERNS,
        folders: bool = True,
        retry_seconds: float = 30.0,
        lock: bool = True,
        same_content: Callable[[Path, Path], None] | None = None,
    ):
        self.inbox = Path(inbox)
        self.ledger_path = Path(ledger_path)
        self.settle_seconds = settle_seconds
        self.poll_seconds = poll_seconds
        self.patterns = tuple(patterns)
        self.folders = folders
        self.retry_seconds = retry_seconds
        self.lock = lock
        self.same_content = same_content
        self._ledger_in_inbox = self.ledger_path.resolve().parent == self.inbox.resolve()
        self._ledger: ResultLog | None = None
        self._done_hashes: dict[str, str] = {}  # content hash -> path it was processed as
        self._done_sigs: dict[str, str] = {}  # relative path -> signature id when handled
        self._seen: dict[Path, tuple[Signature, float]] = {}  # path -> (signature, first seen at)
        self._hashes: dict[Path, tuple[Signature, str]] = {}
        self._retry_at: dict[Path, float] = {}
        self._warned_empty: set[Path] = set()
        # this session's outcome per file, the last one where a file came again
        # (a half-copied file failed, then its whole copy): what run() returns
        self.outcomes: dict[Path, str] = {}

    # -- ledger ----------------------------------------------------------
    def _open_ledger(self) -> ResultLog:
        if self._ledger is None:
            ledger = ResultLog(self.ledger_path).open()
            for entry in ledger.records():
                self._remember(entry.get("path"), entry.get("content_hash"), entry.get("sig"))
            self._ledger = ledger
            logger.debug("%s: %d documents already handled", self.ledger_path, len(self._done_hashes))
        return self._ledger

    def _remember(self, rel: str | None, digest: str | None, sig: str | None) -> None:
        if digest:
            self._done_hashes.setdefault(digest, rel or "?")
        if rel and sig:
            self._done_sigs[rel] = sig

    def _rel(self, path: Path) -> str:
        try:
            return path_text(Path(path).relative_to(self.inbox).as_posix())
        except ValueError:
            return path_text(path)

    def mark_done(self, path: Path, content_hash: str, status: str, *, error: str | None = None) -> None:
        """Durably record that ``path`` (with ``content_hash``) was handled."""
        path = Path(path)
        cached = self._hashes.get(path)
        if cached and cached[1] == content_hash:
            sig = cached[0]  # as hashed: if it changed while being handled, it is offered again
        else:
            try:
                sig = self._signature(path)
            except OSError:
                sig = None  # vanished after handling: the hash still prevents a redo
        rel = self._rel(path)
        entry = {"key": content_hash, "status": status, "path": rel, "content_hash": content_hash,
                 "sig": _sig_id(sig) if sig else None, "error": error, "at": utc_now()}
        if (raw := path_b64(path.relative_to(self.inbox) if path.is_relative_to(self.inbox) else path)) is not None:
            entry["path_b64"] = raw  # the raw bytes of a name that is not UTF-8
        self._open_ledger().append(entry)
        self._remember(rel, content_hash, entry["sig"])
        self._forget(path)

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    # -- scanning --------------------------------------------------------
    def _documents_in(self, folder: Path) -> list[Path]:
        """The images and PDFs of a dropped folder: what its signature and
        digest cover (the run reads it as a job input folder: its PDFs, and
        its images as an image set)."""
        return sorted((p for p in folder.iterdir() if p.is_file() and not _matches(p.name, TEMP_PATTERNS)
                       and p.suffix.lower() in IMAGE_SUFFIXES | PDF_SUFFIXES), key=natural_key)

    def _signature(self, path: Path) -> Signature:
        if path.is_dir():
            return tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in self._documents_in(path))
        st = path.stat()
        return (st.st_size, st.st_mtime_ns)

    def _candidates(self) -> list[tuple[Path, Signature]]:
        out = []
        for path in sorted(self.inbox.iterdir(), key=natural_key):
            if _matches(path.name, TEMP_PATTERNS) or self._is_ours(path):
                continue
            try:
                if path.is_dir():
                    if not self.folders:
                        continue
                    sig = self._signature(path)
                    if not sig:
                        continue  # no images or PDFs (yet)
                elif _matches(path.name, self.patterns):
                    sig = self._signature(path)
                    if sig[0] == 0:
                        if path not in self._warned_empty:
                            self._warned_empty.add(path)
                            logger.info("inbox: %s is empty; waiting for content", shown(path))
                        continue
                else:
                    continue
            except FileNotFoundError:
                continue  # vanished while scanning
            except OSError as e:  # one unreadable entry must not hide the others
                logger.debug("inbox: cannot stat %s: %s", shown(path), e)
                continue
            out.append((path, sig))
        return out

    def _is_ours(self, path: Path) -> bool:
        """The ledger and its lock/torn siblings, should they live in the inbox."""
        return self._ledger_in_inbox and path.name.startswith(self.ledger_path.name)

    def _hash(self, path: Path) -> str:
        if path.is_dir():
            ref = DocumentRef(source=path, kind="images", doc_id=path.name, members=tuple(self._documents_in(path)))
        elif path.suffix.lower() in IMAGE_SUFFIXES:
            ref = DocumentRef(source=path, kind="images", doc_id=path.name, members=(path,))
        else:
            ref = DocumentRef(source=path, kind="pdf", doc_id=path.name)
        return content_hash(ref)

    def poll(self) -> list[Path]:
        """Settled, not yet handled documents in the inbox, in natural order."""
        self._open_ledger()
        now = time.monotonic()
        try:
            candidates = self._candidates()
        except OSError as e:
            logger.warning("inbox %s cannot be listed: %s", self.inbox, e.strerror or e)
            return []
        ready = []
        for path, sig in candidates:
            if self._done_sigs.get(self._rel(path)) == _sig_id(sig):
                continue  # handled before, unchanged since: no need to reread it
            seen = self._seen.get(path)
            if seen is None or seen[0] != sig:
                self._seen[path] = (sig, now)  # new or still changing: (re)start the settle clock
                continue
            if now - seen[1] < self.settle_seconds or self._retry_at.get(path, 0.0) > now:
                continue
            if open_for_writing_elsewhere(path):
                self._seen[path] = (sig, now)  # a writer still has it open: wait, whatever the pause
                continue
            digest = self._cached_hash(path, sig)
            if digest is None:
                continue
            if digest in self._done_hashes:
                original = self._done_hashes[digest]
                logger.info("inbox: %s has the same content as %s, already handled", shown(path), shown(original))
                if self.same_content is not None and (self.inbox / original).exists():
                    self.same_content(path, self.inbox / original)
                self.mark_done(path, digest, "duplicate")
                continue
            ready.append(path)
        for gone in set(self._seen) - {p for p, _ in candidates}:
            self._forget(gone)
        return ready

    def _cached_hash(self, path: Path, sig: Signature) -> str | None:
        cached = self._hashes.get(path)
        if cached and cached[0] == sig:
            return cached[1]
        try:
            digest = self._hash(path)
            after = self._signature(path)
        except (OSError, IngestError) as e:
            if not path.exists():
                self._forget(path)
                return None
            logger.warning("inbox: cannot read %s: %s; will retry", shown(path), e)
            self._retry_at[path] = time.monotonic() + self.retry_seconds
            return None
        if after != sig:  # still being written after all
            self._seen[path] = (after, time.monotonic())
            return None
        self._hashes[path] = (sig, digest)
        return digest

    def _forget(self, path: Path) -> None:
        for table in (self._seen, self._hashes, self._retry_at):
            table.pop(path, None)
        self._warned_empty.discard(path)

    # -- loop ------------------------------------------------------------
    def handle_one(self, handle: Callable[[Path], str | None], path: Path) -> str | None:
        """Run ``handle(path)`` and record the outcome; returns the ledger status
        (None when the file vanished or the failure was transient)."""
        sig, digest = self._hashes[path]
        logger.info("inbox: processing %s", shown(path))
        try:
            status = handle(path) or "ok"
            error = None
        except Exception as e:  # noqa: BLE001 - one bad file must not stop the watcher
            if not path.exists():
                logger.warning("inbox: %s vanished while being processed; skipped", shown(path))
                self._forget(path)
                return None
            if _is_transient(e):
                logger.error("inbox: %s: %s; will retry in %.0f s", shown(path), e, self.retry_seconds)
                self._retry_at[path] = time.monotonic() + self.retry_seconds
                return None
            if isinstance(e, RunError):
                raise  # the model does not load: no file's fault, the watcher stops (exit 4)
            detail = str(e) if isinstance(e, TqpipeError) else f"{type(e).__name__}: {e}"
            logger.error("inbox: %s failed: %s", shown(path), detail, exc_info=logger.isEnabledFor(logging.DEBUG))
            status, error = "failed", detail
        try:
            self.mark_done(path, digest, status, error=error)
        except CheckpointError as e:
            logger.error("inbox: %s; %s will be offered again (finished tasks are skipped)", e, shown(path))
            self._retry_at[path] = time.monotonic() + self.retry_seconds
            return None
        logger.info("inbox: %s -> %s", shown(path), status)
        self.outcomes[path] = status
        return status

    def run(self, handle: Callable[[Path], str | None], *, stop: threading.Event | None = None,
            max_iterations: int | None = None) -> dict[Path, str]:
        """Poll, handle each settled file, sleep ``poll_seconds``; until ``stop``
        is set or ``max_iterations`` polls have run.  Returns :attr:`outcomes`
        (each file handled in this session and its last ledger status), from
        which the CLI's exit code says whether any document failed.

        ``handle(path)`` processes one document and returns a short status for
        the ledger (None means "ok").  It raising marks the file failed, except
        when the file vanished (skipped) or the error is not the file's fault
        (lock held by a cron run, results disk full: retried later).
        Holds a lock on the ledger, so two watchers never share one inbox.
        """
        if not self.inbox.is_dir():
            raise InboxError(f"{shown(self.inbox)}: inbox folder does not exist")
        stop = stop or threading.Event()
        with JobLock(self.ledger_path) if self.lock else nullcontext():
            try:
                iterations = 0
                while not stop.is_set():
                    for path in self.poll():
                        if stop.is_set():
                            break
                        self.handle_one(handle, path)
                    iterations += 1
                    if max_iterations is not None and iterations >= max_iterations:
                        break
                    stop.wait(self.poll_seconds)
            finally:
                self.close()
        return self.outcomes


class InboxError(TqpipeError):
    """The inbox itself is unusable (missing, not a folder): a usage error (exit 2)."""


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, (LockHeldError, CheckpointError)):
        return True
    cause = e if isinstance(e, OSError) else e.__cause__
    return isinstance(cause, OSError) and cause.errno in _TRANSIENT_ERRNOS
