"""Which file ``output:`` may name (a new file or an existing tqpipe results
file), whether it can be written, and which file ``export`` / ``report`` may
overwrite (:func:`derived_output_problem`).

Results are appended, so a wrong ``output:`` destroys whatever it points at:
an input PDF gets JSON lines glued to it, the job file is corrupted.  The
folder is free (users share result folders, outside the job's own folder
too), the file is not.  Refused, each with one line naming the path and
the reason (a :class:`~pipeline.errors.JobFileError`, exit 2):

* a folder, or anything that is not a regular file;
* the job file itself, or a document of the job's inputs;
* a symlink whose target is refused by these rules, or dangling;
* an existing file that is not tqpipe JSONL: its first line must be a
  record (a JSON object with ``schema_version`` and ``key``), or the start
  of one torn by a crash.  An empty file is fine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import orjson

from pipeline.errors import JobFileError
from pipeline.inputs.discover import DocumentRef, discover
from pipeline.schema.job import Job
from pipeline.schema.paths import shown

_HEAD = 1 << 16  # the first line of a results file is one record: far less than this
_RECORD_START = b'{"schema_version":'  # make_record puts it first
_PROBE_LINES = 8  # whole lines looked at for a record before a file is called foreign


def check_output(job: Job, refs: Iterable[DocumentRef] | None = None) -> Path:
    """Raise :class:`JobFileError` unless ``job.output_path`` may be appended to;
    return the resolved path (symlinks followed) that will be written."""
    out = job.output_path
    real = Path(os.path.realpath(out))

    def refuse(reason: str) -> None:
        where = shown(out) if real == out else f"{shown(out)} (-> {shown(real)})"
        raise JobFileError(job.path, "output", f"{where}: {reason}; name a new file or an existing tqpipe results file")

    if out.is_symlink() and not real.exists():
        refuse("is a symlink to nothing")
    if not real.exists():
        return real
    if real.is_dir():
        refuse("is a folder")
    if not real.is_file():
        refuse("is not a regular file")
    if real == Path(os.path.realpath(job.path)):
        refuse("is the job file itself")
    for ref in discover(job) if refs is None else refs:
        for f in ref.members or (ref.source,):
            if Path(os.path.realpath(f)) == real:
                refuse(f"is an input document of this job ({shown(ref.doc_id)})")
    reason = _not_results(real)
    if reason:
        refuse(reason)
    return real


def _not_results(path: Path) -> str | None:
    """Why ``path`` is not a tqpipe results file, or None if it is one (or empty).

    It is one when a record comes first, or, past a damaged start (a line
    mangled by an editor or a disk fault, a byte-order mark), among the
    first :data:`_PROBE_LINES` whole lines: readers skip such a line with a
    warning and its key is simply done again, so one bad line must not
    make every record in the file unreachable.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not head.strip():
        return None
    lines = head.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    whole, last = lines[:-1], lines[-1]
    if not whole:  # one line, maybe torn by a crash during the first append
        return None if last.startswith(_RECORD_START) else "is not a tqpipe results file (JSONL records)"
    for line in [x for x in whole if x.strip()][:_PROBE_LINES]:
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "schema_version" in rec and isinstance(rec.get("key"), str):
            return None
    return "is not a tqpipe results file (none of its first lines is a tqpipe record)"


def unwritable(path: Path) -> str | None:
    """Why the results file ``path`` (and its ``.lock`` beside it) cannot be
    written, or None.  ``validate`` asks so that a job it passes does not stop
    at the first append (``run`` would exit 4 there); a full disk cannot be
    foreseen and is still met by the append itself."""
    folder = path if path.is_dir() else path.parent
    while not folder.exists():  # a folder the run will create: its nearest existing ancestor decides
        folder = folder.parent
    if not folder.is_dir():
        return f"{shown(folder)} is a file where a folder of the output's path would have to be"
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"{shown(folder)} is on a read-only file system"
    except OSError as e:
        return f"{shown(folder)}: {e.strerror or e}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {shown(folder)} is not writable"
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is not writable"
    return None


def derived_output_problem(job: Job, out: Path, suffix: str) -> str | None:
    """Why ``export`` / ``report`` must not write ``out`` (a ``suffix`` file),
    or None.  They overwrite their target, so only a new file or one of their
    own kind (that suffix) may be named: never the results file, the job file,
    an input document or a folder."""
    real = Path(os.path.realpath(out))
    if real == Path(os.path.realpath(job.output_path)):
        return "is the job's results file"
    if real.is_dir():
        return "is a folder"
    if real.exists() and real.suffix.lower() != suffix:
        return f"exists and is not a {suffix} file; name a new file or a {suffix} file to overwrite"
    return None
