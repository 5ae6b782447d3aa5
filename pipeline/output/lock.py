"""One run per job at a time: an OS-level lock next to the results file.

Cron starts a job every hour; if the previous run is still going, the new
one must exit at once and say who holds the lock, not wait and not append to
the same results file concurrently.  ``filelock`` gives us ``flock(2)``,
which the kernel releases when the holder dies, so a ``kill -9``'d run never
leaves a stale lock behind.  The soft (marker-file) fallback of filelock is
disabled for that reason: a marker survives the process and would block all
later runs.

``flock`` only knows "locked", not by whom, so the holder writes pid, host,
start time and command line into a sidecar ``<lock>.owner`` for the error
message.  The sidecar is informational only; the flock decides.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import orjson
from filelock import FileLock, Timeout

from pipeline.errors import CheckpointError, LockHeldError, TqpipeError
from pipeline.schema.paths import text_safe
from pipeline.schema.record import utc_now

logger = logging.getLogger(__name__)


def lock_path_for(target: Path) -> Path:
    """``results.jsonl`` -> ``results.jsonl.lock``."""
    target = Path(target)
    return target.with_name(target.name + ".lock")


class JobLock:
    """Non-blocking exclusive lock on ``<target>.lock``.

    ``target`` is the job's output file (or any file a single process must
    own, e.g. the inbox ledger).  ``acquire`` raises :class:`LockHeldError`
    immediately if another process holds it.
    """

    def __init__(self, target: Path, *, job: str | None = None):
        self.target = Path(target)
        self.path = lock_path_for(self.target)
        self.owner_path = self.path.with_name(self.path.name + ".owner")
        self.job = job
        self._lock = FileLock(self.path, timeout=0, fallback_to_soft=False, thread_local=False)

    @property
    def is_locked(self) -> bool:
        return self._lock.is_locked

    def acquire(self) -> "JobLock":
        if self._lock.is_locked:
            raise TqpipeError(f"{self.path}: JobLock is not reentrant; already held by this object")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
        except Timeout:
            raise LockHeldError(self.path, self._describe_holder()) from None
        except OSError as e:  # read-only or missing folder: the run cannot proceed (exit 4)
            from pipeline.output.target import unwritable

            why = unwritable(self.path) or e.strerror or str(e)  # names a file blocking the folder, say
            raise CheckpointError(f"{self.path}: cannot create lock file: {why}") from e
        self._write_owner()
        logger.debug("%s: acquired", self.path)
        return self

    def release(self) -> None:
        if not self._lock.is_locked:
            return
        try:
            self.owner_path.unlink(missing_ok=True)
        except OSError:
            pass  # informational file; the flock below is what matters
        self._lock.release()
        logger.debug("%s: released", self.path)

    def __enter__(self) -> "JobLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _write_owner(self) -> None:
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": utc_now(),
            "job": self.job,
            "argv": [text_safe(a) for a in sys.argv],  # a file name argument may not be UTF-8
        }
        tmp = self.owner_path.with_name(f"{self.owner_path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(orjson.dumps(owner))
            os.replace(tmp, self.owner_path)  # readers never see a half-written sidecar
        except (OSError, orjson.JSONEncodeError) as e:
            tmp.unlink(missing_ok=True)  # a full disk must not leave an empty .tmp behind
            logger.warning("%s: could not write lock owner info: %s", self.owner_path, e)

    def _describe_holder(self) -> str | None:
        try:
            owner = orjson.loads(self.owner_path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None  # the holder is between acquiring and writing the sidecar
        parts = [f"pid {owner.get('pid')} on {owner.get('host')}", f"since {owner.get('started_at')}"]
        if owner.get("job"):
            parts.insert(0, f"job {owner['job']!r}")
        text = ", ".join(parts)
        argv = owner.get("argv") or []
        if argv:
            text += f" (command: {' '.join(map(str, argv))[:200]})"
        return text
