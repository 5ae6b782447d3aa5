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

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
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


class ModelLoadError(TqpipeError):
    """A model path or hub id cannot be loaded (missing, offline, wrong kind)."""


class ContextOverflowError(TqpipeError):
    """A document does not fit the context limit and the job says ``overflow: error``."""


class CheckpointError(TqpipeError):
    """The results file cannot be read or written safely."""
