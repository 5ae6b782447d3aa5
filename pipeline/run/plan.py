"""The work plan: which (document, task) pairs a run still has to do.

One plan serves the local runner, the Ray driver, the inbox watcher (through
the runner) and ``tqpipe status``, so the record keys and the skip rule exist
once.  A record key is ``<content hash>/<task>/<config hash>``: the content
hash changes exactly when the file's bytes do, the config hash exactly when
something that shapes that task's output does (its own fields, the model
setting, the cache and context specs, ``--pages`` included).  A key already
in the results file is done; an error record counts as done unless the run
retries failures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from pipeline.inputs.discover import DocumentRef, content_hash
from pipeline.output.results_log import ResultLog
from pipeline.schema.job import Job, TaskSpec
from pipeline.schema.record import record_key, task_config_hash

#: The model identity in config hashes when the job names none.  The key must
#: be known before any document is read, so it uses the job's setting, not
#: the model picked per document (that choice is a deterministic function of
#: the document and the context spec, both already in the key).
AUTO_MODEL = "builtin:auto"


def model_setting(job: Job) -> str:
    """The model identity used in config hashes: the job's path, or ``builtin:auto``."""
    return job.spec.model.path or AUTO_MODEL


def task_keys(job: Job, digest: str, tasks: Sequence[TaskSpec] | None = None) -> dict[str, str]:
    """``{task name: record key}`` for one document content hash."""
    spec = job.spec
    out = {}
    for task in tasks if tasks is not None else spec.tasks:
        chash = task_config_hash(task, model=model_setting(job), cache=spec.cache, context=spec.context)
        out[task.name] = record_key(digest, task.name, chash)
    return out


def config_hash_of(key: str) -> str:
    """The config hash part of a record key."""
    return key.rsplit("/", 1)[1]


@dataclass(frozen=True)
class DocumentWork:
    """One document's share of a run.

    ``digest`` is None when the file could not be read: then every task is
    to do and ``keys`` is empty (processing records the read error).
    ``failed_before`` counts the tasks skipped because an earlier run
    recorded them as failed; they still count for the exit code.
    """

    ref: DocumentRef
    digest: str | None
    tasks: list[TaskSpec]
    keys: dict[str, str]
    failed_before: int = 0


class WorkPlan:
    """The keys and the skip rule of one job; ``retry_failed`` redoes error records."""

    def __init__(self, job: Job, *, retry_failed: bool = False):
        self.job = job
        self.retry_failed = retry_failed

    def document(self, ref: DocumentRef, log: ResultLog) -> DocumentWork:
        """What is left of ``ref`` given the results in ``log`` (hashes the file, reads no pages)."""
        tasks = list(self.job.spec.tasks)
        try:
            digest = content_hash(ref)
        except OSError:
            return DocumentWork(ref, None, tasks, {})
        keys = task_keys(self.job, digest)
        todo = [t for t in tasks if not log.is_done(keys[t.name], include_failed=not self.retry_failed)]
        todo_names = {t.name for t in todo}
        failed_before = 0
        if not self.retry_failed:
            failed_before = sum(
                1 for t in tasks if t.name not in todo_names and not log.is_done(keys[t.name], include_failed=False)
            )
        return DocumentWork(ref, digest, todo, keys, failed_before)

    def expected_keys(self, refs: Iterable[DocumentRef]) -> tuple[set[str], int]:
        """Every key the job produces for ``refs``, and how many files could not be read."""
        expected: set[str] = set()
        unreadable = 0
        for ref in refs:
            try:
                expected.update(task_keys(self.job, content_hash(ref)).values())
            except OSError:
                unreadable += 1
        return expected, unreadable
