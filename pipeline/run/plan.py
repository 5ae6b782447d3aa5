"""The work plan: which (document, task) pairs a run still has to do.

One plan serves the local runner, the Ray driver, the inbox watcher (through
the runner) and ``tqpipe status``, so the record keys and the skip rule exist
once.  A record key is ``<content hash>/<task>/<config hash>``: the content
hash changes exactly when the file's bytes do, the config hash exactly when
something that shapes that task's output does (its own fields, the model
setting, the cache and context specs, ``--pages`` included).  A key already
in the results file is done; an error record counts as done unless the run
retries failures or the error was transient (I/O, memory) and has attempts
left (:data:`~pipeline.output.results_log.TRANSIENT_ATTEMPTS`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from pipeline.errors import IngestError
from pipeline.inputs.discover import DocumentRef, content_hash, discover, name_tag, unreadable_digest
from pipeline.output.results_log import KeyIndex, ResultLog, read_index
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
        chash = task_config_hash(task.hash_fields(), model=model_setting(job), cache=spec.cache, context=spec.context)
        out[task.name] = record_key(digest, task.name, chash)
    return out


def config_hash_of(key: str) -> str:
    """The config hash part of a record key."""
    return key.rsplit("/", 1)[1]


@dataclass(frozen=True)
class DocumentWork:
    """One document's share of a run.

    ``digest`` is None when the file could not be read: then ``keys`` are
    those of :func:`~pipeline.inputs.discover.unreadable_digest` (processing
    records the read error).  ``failed_before`` counts the tasks skipped
    because an earlier run recorded them as failed, ``warned_before`` those
    recorded ok with quality warnings; both still count for the exit code.
    ``same_as`` is set for a second name of content already seen in this
    run: its tasks are answered by copying the first name's records
    (``same_content_as``), which share that one prefill; ``original_keys``
    are the first name's keys.
    """

    ref: DocumentRef
    digest: str | None
    tasks: list[TaskSpec]
    keys: dict[str, str]
    failed_before: int = 0
    warned_before: tuple[tuple[str, ...], ...] = ()  # the warnings of each such task
    same_as: DocumentRef | None = None
    original_keys: dict[str, str] = field(default_factory=dict)


class WorkPlan:
    """The keys and the skip rule of one job; ``retry_failed`` redoes error records.

    Identical bytes under two names give two sets of records: the first
    name's keys ``<hash>/<task>/<config>``, the second name's
    ``<hash>@<name tag>/<task>/<config>``.  The first name is the one the
    results file already holds that content under, if that file still
    exists and is one of the job's ``documents`` (so renaming a file, or
    copying a project folder with its results, reruns nothing and leaves
    no task waiting on a document the run never processes), else the first
    in discovery order; one plan per run (or per ``status``) remembers that
    order.  ``documents``: the job's discovered set; None (the files
    ``tqpipe watch`` hands over one arrival at a time, whose other names
    are earlier arrivals): any existing file counts.
    """

    def __init__(self, job: Job, *, retry_failed: bool = False, documents: Iterable[DocumentRef] | None = None):
        self.job = job
        self.retry_failed = retry_failed
        self._documents = None if documents is None else {os.fsencode(r.source) for r in documents}
        self._first: dict[str, DocumentRef] = {}
        self._suffixes: set[str] | None = None  # "<task>/<config hash>" of the present tasks (is_current)

    def _keys(self, ref: DocumentRef, index: KeyIndex | None
              ) -> tuple[str | None, dict[str, str], DocumentRef | None, dict[str, str]]:
        try:
            digest = content_hash(ref)
        except IngestError:
            return None, task_keys(self.job, unreadable_digest(ref)), None, {}
        keys = task_keys(self.job, digest)
        first = self._recorded_under(ref, keys, index) or self._first.setdefault(digest, ref)
        if first.source == ref.source and first.members == ref.members:
            return digest, keys, None, {}
        return digest, task_keys(self.job, f"{digest}@{name_tag(ref)}"), first, keys

    def _recorded_under(self, ref: DocumentRef, keys: dict[str, str], index: KeyIndex | None) -> DocumentRef | None:
        """The other document of the job the results already hold this content
        under, if it still exists (a renamed file's old name does not, the
        original of a copied project is not in the run: then it is ours)."""
        if index is None:
            return None
        for key in keys.values():
            source = index.source(key)
            if source is None:
                continue
            name = os.fsencode(source)
            if name == os.fsencode(ref.source) or not source.exists() or (
                    self._documents is not None and name not in self._documents):
                return None
            doc_id = Path(os.path.relpath(source, self.job.base_dir)).as_posix()
            return DocumentRef(source=source, kind=ref.kind, doc_id=doc_id)
        return None

    def is_current(self, key: str) -> bool:
        """Whether a record key belongs to the job's present tasks and config
        (its ``<task>/<config hash>`` part), whatever the document."""
        if self._suffixes is None:
            self._suffixes = {k.split("/", 1)[1] for k in task_keys(self.job, "x").values()}
        return key.split("/", 1)[-1] in self._suffixes

    def recorded_keys(self, index: KeyIndex) -> set[str]:
        """The keys ``index`` holds under the job's current tasks and config,
        the latest per file name and task: what an inbox job (``inputs: []``,
        fed by ``tqpipe watch``) has produced, since its documents are not
        listed anywhere the job file could find them again.  An older
        result for the same file (a half copy that failed, a folder before
        its last image arrived) is superseded, not counted."""
        return index.latest_per_name({k for k in index.done_keys | index.failed_keys if self.is_current(k)})

    def counts(self) -> Callable[[str], bool]:
        """Whether a record key is one of the job's results: of its present
        tasks and config; for a job tqpipe watch feeds (no documents of its
        own), also the latest for its file (:meth:`recorded_keys`, the only
        case that reads the results file here).  What status counts and
        export, report and ``read_results`` show."""
        if discover(self.job):
            return self.is_current
        return self.recorded_keys(read_index(self.job.output_path)[0]).__contains__

    def document(self, ref: DocumentRef, log: ResultLog) -> DocumentWork:
        """What is left of ``ref`` given the results in ``log`` (hashes the file, reads no pages)."""
        tasks = list(self.job.spec.tasks)
        digest, keys, same_as, original = self._keys(ref, log.index)
        todo = [t for t in tasks if not log.is_done(keys[t.name], include_failed=not self.retry_failed)]
        todo_names = {t.name for t in todo}
        failed_before, warned_before = 0, []
        for t in tasks:
            if t.name in todo_names:
                continue
            if not log.is_done(keys[t.name], include_failed=False):
                failed_before += 1
            elif found := log.index.warnings(keys[t.name]):
                warned_before.append(found)
        return DocumentWork(ref, digest, todo, keys, failed_before, tuple(warned_before), same_as, original)

    def expected_keys(self, refs: Iterable[DocumentRef], index: KeyIndex | None = None) -> tuple[set[str], int]:
        """Every key the job produces for ``refs`` (``index``: what the results
        file holds, which decides second names as in a run), and how many
        files could not be read."""
        expected: set[str] = set()
        unreadable = 0
        for ref in refs:
            digest, keys, _, _ = self._keys(ref, index)
            unreadable += digest is None
            expected.update(keys.values())
        return expected, unreadable
