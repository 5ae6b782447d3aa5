"""The project's exception types.

Every error a user can cause (bad job file, broken document, lock held) is a
``TqpipeError`` so the CLI can map it to an exit code and print ONE clear line
instead of a traceback.  Each message names the file and the problem, because
a batch job over hundreds of documents is useless if the log says only
"invalid value".
"""

from __future__ import annotations

from pathlib import Path


class TqpipeError(Exception):
    """Base class: an expected, user-facing failure with a readable message."""


class JobFileError(TqpipeError):
    """A job file is missing, not valid YAML, or fails schema validation.

    ``key`` is a dotted path into the job (``tasks[1].max_tokens``) or None
    when the whole file is at fault (missing file, YAML syntax error).
    """

    def __init__(self, path: str | Path, key: str | None, problem: str):
        self.path = str(path)
        self.key = key
        self.problem = problem
        where = f"{self.path}: {key}" if key else self.path
        super().__init__(f"{where}: {problem}")


class IngestError(TqpipeError):
    """A document cannot be read (encrypted, corrupt, empty, zero bytes, too
    many failed pages, page range out of bounds).  The runner turns it into an
    error record for that document and goes on with the next one."""

    def __init__(self, path: str | Path, problem: str, *, transient: bool = False):
        from pipeline.schema.paths import shown

        self.path = shown(path)
        self.problem = problem
        #: True when the failure is not the document's content (an I/O error,
        #: a file that vanished): a plain rerun retries it (see pipeline.run.plan).
        self.transient = transient
        super().__init__(f"{self.path}: {problem}")


class PageRangeError(TqpipeError, ValueError):
    """A ``pages:`` spec is malformed or does not fit a document.

    ``document`` is set when the spec is checked against a particular file.
    It is also a ValueError so pydantic validators can raise it directly.
    """

    def __init__(self, spec: str, problem: str, document: str | Path | None = None):
        self.spec = spec
        self.problem = problem
        self.document = None if document is None else str(document)
        prefix = f"{self.document}: " if self.document else ""
        super().__init__(f"{prefix}pages {spec!r}: {problem}")


class LockHeldError(TqpipeError):
    """Another run holds the job's output lock; ``holder`` describes who."""

    def __init__(self, path: str | Path, holder: str | None = None):
        self.path = str(path)
        self.holder = holder
        who = f" by {holder}" if holder else ""
        super().__init__(f"{self.path}: locked{who}; another run of this job is in progress")


class RunError(TqpipeError):
    """The run as a whole cannot proceed (model, output file, disk, lock file).

    No document is to blame, so no per-document error record is written: a
    record would mark every document failed and a plain rerun would then skip
    them all.  The CLI exits with code 4 (see :mod:`pipeline.cli`).
    """


class ModelLoadError(RunError, ValueError):
    """A model path or hub id cannot be loaded (missing, offline, wrong kind).

    Also a ValueError: callers that validate model paths catch it as one.
    """


class ContextOverflowError(TqpipeError):
    """A document does not fit the context limit and the job says ``overflow: error``."""


class CheckpointError(RunError):
    """The results file (or its lock or ledger) cannot be read or written safely."""
