"""The Ray engine: documents spread over a cluster, one loaded model per actor.

``tqpipe run JOB --engine ray`` uses Ray (an existing, well-tested distributed
engine) instead of a home-made scheduler.  The shape is chosen for the three
promises the local engine already makes:

* **One prefill per document.**  Each ``DocumentWorker`` actor loads the model
  once and processes WHOLE documents through the runner's own
  ``process_document``, so every task of a document reuses its one prefill,
  exactly as locally.
* **Exactly-once results.**  Workers never write files: an actor returns the
  records of one document and the driver appends them through the same
  ``ResultLog`` (and under the same ``JobLock``) as the local engine.  A worker
  killed mid-document therefore loses nothing that was written - none of that
  document was written yet - and its document is resubmitted to a live
  worker, at most ``engine.max_retries`` times, then recorded as failed.  A
  killed driver resumes from the checkpoint like the local runner.  A single
  writer also means no concurrent appends to one file over NFS.
* **Flat memory.**  Documents are pulled lazily from a generator and at most
  ``workers * max_in_flight_per_worker`` are submitted at any moment
  (``ray.wait(num_returns=1)`` frees a slot before the next submit), so a
  10,000-document job holds a handful of ObjectRefs, not 10,000.  Two in
  flight per worker keeps each actor busy while the driver writes.

Ray is imported lazily: the local engine never imports it.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

logger = logging.getLogger(__name__)

# Failures that mean "the worker (process or node) is gone", not "the document
# is bad": the document is retried elsewhere.  Resolved lazily (Ray import).
_LOST_WORKER_ERRORS = ("RayActorError", "WorkerCrashedError", "OutOfMemoryError", "ObjectLostError")


@dataclass
class WorkItem:
    """One document on its way through the cluster.

    ``payload`` is what the worker needs (pickled to it); ``attempts`` counts
    the worker deaths charged to this document; ``suspect`` marks a document
    that was on a worker when it died, which from then on runs alone on its
    worker (see :class:`Dispatcher`).
    """

    doc_id: str
    payload: Any
    attempts: int = 0
    suspect: bool = False
    errors: list[str] = field(default_factory=list)


@dataclass
class DispatchStats:
    """What the dispatcher did; the tests read the bounds from here."""

    submitted: int = 0
    completed: int = 0
    gave_up: int = 0
    worker_deaths: int = 0
    resubmitted: int = 0
    max_in_flight: int = 0
    # Items taken from the source and not yet finished (in flight + waiting to
    # be resubmitted): the driver's whole working set of documents.
    max_outstanding: int = 0


@dataclass
class _Slot:
    """One worker position; its actor is replaced when it dies."""

    index: int
    actor: Any
    queue: list = field(default_factory=list)  # ObjectRefs, submission order
    isolated: bool = False  # running a suspect: nothing else is queued behind it


class Dispatcher:
    """Bounded, retrying distribution of ``WorkItem``s over replaceable actors.

    Kept free of pipeline concerns (files, records) so its guarantees - the
    in-flight bound, lazy pulling, charging a death to the right document - can
    be tested on their own.

    ``make_actor(index)`` creates an actor whose ``process.remote(payload)``
    returns the document's result.  Each actor has up to
    ``max_in_flight_per_worker`` calls queued so it never waits for the
    driver.  When an actor dies, which of its queued documents killed it is
    not knowable from outside: not even "the oldest" - a worker that dies
    right after finishing a call can lose that call's reply, and Ray then
    reports the finished call as failed too.  So a death with several
    documents outstanding charges none of them: all become *suspects* and are
    resubmitted, each running alone on a worker (nothing queued behind it).
    A death with one document outstanding is unambiguous and charges it one
    attempt; after ``max_retries + 1`` charged attempts it is given up.  No
    result reached the driver from any of them, so nothing is written twice.
    """

    def __init__(
        self,
        make_actor: Callable[[int], Any],
        *,
        workers: int,
        max_in_flight_per_worker: int,
        max_retries: int,
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1 (got {workers})")
        if max_in_flight_per_worker < 1:
            raise ValueError(f"max_in_flight_per_worker must be >= 1 (got {max_in_flight_per_worker})")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0 (got {max_retries})")
        self.make_actor = make_actor
        self.workers = workers
        self.per_worker = max_in_flight_per_worker
        self.max_retries = max_retries
        self.stats = DispatchStats()
        self.slots: list[_Slot] = []

    def start(self) -> None:
        """Create the actors (idempotent).  Separate so callers can wait for them."""
        if not self.slots:
            self.slots = [_Slot(i, self.make_actor(i)) for i in range(self.workers)]

    def run(
        self,
        source: Iterable[WorkItem],
        on_result: Callable[[WorkItem, Any], None],
        on_error: Callable[[WorkItem, BaseException], None],
        on_give_up: Callable[[WorkItem], None],
    ) -> DispatchStats:
        """Process every item of ``source`` exactly once (result, error or give-up).

        ``on_result`` gets the worker's return value; ``on_error`` an exception
        raised by the document's own processing (deterministic, so not
        retried); ``on_give_up`` an item charged ``max_retries + 1`` worker
        deaths.  Callbacks run on the driver, one at a time, right after each
        document finishes.
        """
        import ray

        lost = tuple(getattr(ray.exceptions, name) for name in _LOST_WORKER_ERRORS)
        self.start()
        source = iter(source)
        retry: deque[WorkItem] = deque()
        pending: dict[Any, tuple[_Slot, WorkItem]] = {}
        held: WorkItem | None = None  # taken from source/retry, waiting for a slot
        exhausted = False
        stats = self.stats

        while True:
            while True:
                if held is None:
                    if retry:
                        held = retry.popleft()
                    elif not exhausted and self._slot_for(None) is not None:
                        # Pull only when it can be submitted: the source is
                        # never read ahead of the in-flight bound.
                        held = next(source, None)
                        exhausted = held is None
                if held is None:
                    break
                slot = self._slot_for(held)
                if slot is None:
                    break
                obj = slot.actor.process.remote(held.payload)
                slot.queue.append(obj)
                slot.isolated = held.suspect
                pending[obj] = (slot, held)
                held = None
                stats.submitted += 1
                stats.max_in_flight = max(stats.max_in_flight, len(pending))
            stats.max_outstanding = max(stats.max_outstanding, len(pending) + len(retry) + (held is not None))
            if not pending:
                return stats

            (obj,), _ = ray.wait(list(pending), num_returns=1)
            slot, item = pending[obj]
            try:
                result = ray.get(obj)
            except lost as exc:
                self._worker_lost(slot, exc, pending, retry, on_give_up)
                continue
            except ray.exceptions.RayTaskError as exc:
                result, error = None, exc.as_instanceof_cause()
            else:
                error = None
            del pending[obj]
            slot.queue.remove(obj)
            slot.isolated = False
            stats.completed += 1
            if error is None:
                on_result(item, result)
            else:
                on_error(item, error)

    def _slot_for(self, item: WorkItem | None) -> _Slot | None:
        """The least busy slot that may take ``item`` (None: a fresh one) now,
        or None: wait for a call to finish."""
        open_slots = [s for s in self.slots if not s.isolated and len(s.queue) < self.per_worker]
        if item is not None and item.suspect:
            open_slots = [s for s in open_slots if not s.queue]
        return min(open_slots, key=lambda s: len(s.queue), default=None)

    def _worker_lost(self, slot: _Slot, exc: BaseException, pending: dict, retry: deque, on_give_up) -> None:
        """Replace the actor; charge its document if the death is unambiguous,
        else make suspects of all its documents; resubmit them first."""
        import ray

        message = _first_line(exc)
        victims = [pending.pop(o)[1] for o in slot.queue]
        slot.queue.clear()
        slot.isolated = False
        self.stats.worker_deaths += 1
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:  # already gone
            pass
        slot.actor = self.make_actor(slot.index)

        if len(victims) == 1:
            [item] = victims
            item.attempts += 1
            item.errors.append(message)
            logger.warning("worker %d died while processing %s (attempt %d of %d): %s",
                           slot.index, item.doc_id, item.attempts, self.max_retries + 1, message)
            if item.attempts > self.max_retries:
                victims = []
                self.stats.completed += 1
                self.stats.gave_up += 1
                on_give_up(item)
        else:
            logger.warning("worker %d died with %d documents queued (%s); retrying each alone: %s",
                           slot.index, len(victims), ", ".join(v.doc_id for v in victims), message)
        for item in reversed(victims):
            item.suspect = True
            retry.appendleft(item)
            self.stats.resubmitted += 1


@dataclass(frozen=True)
class DocumentTask:
    """What a worker needs for one document (pickled to it).

    ``keys`` are the record keys the driver expects back: a worker whose
    tqpipe computes different keys (another version) is caught at once
    instead of silently breaking exactly-once.
    """

    ref: Any  # pipeline.inputs.ingest.DocumentRef
    digest: str | None  # content hash, None when the driver could not read the file
    tasks: tuple[str, ...]
    keys: tuple[str, ...] = ()


class DocumentWorker:
    """The body of one Ray actor: a loaded model that processes whole documents.

    ``setup(job)`` runs once per actor: by default it builds the runner's
    ``Engines`` and loads the job's model now (the built-in text model for a
    job without one; the built-in VLM loads on the first document with page
    images), so load errors show up before any document is handed out.
    ``process(state, job, task, pages)`` returns the records of one
    document, by default through ``runner.process_document``.  Tests inject
    cheap fakes through these two parameters - the only seam.  The actor
    writes nothing: records go back to the driver.
    """

    def __init__(
        self,
        job: Any,
        *,
        pages: str | None = None,
        setup: Callable[[Any], Any] | None = None,
        process: Callable[[Any, Any, Any, str | None], Iterable[dict]] | None = None,
    ):
        import socket

        self.job = job
        self.pages = pages
        self.where = {"host": socket.gethostname(), "pid": os.getpid()}
        self._process = process or _process_document
        self.state = (setup or _load_engines)(job)

    def ready(self) -> dict:
        """Returns once the model is loaded: where this worker runs."""
        return self.where

    def pid(self) -> int:
        return os.getpid()

    def process(self, task: Any) -> list[dict]:
        records = list(self._process(self.state, self.job, task, self.pages))
        for record in records:
            record["worker"] = self.where
        return records


def _load_engines(job: Any) -> Any:
    from pipeline.run.runner import Engines

    engines = Engines(job)
    engines.get(needs_images=False)
    return engines


def _process_document(engines: Any, job: Any, task: DocumentTask, pages: str | None) -> Iterator[dict]:
    from pipeline.run.runner import process_document

    wanted = set(task.tasks)
    tasks = [t for t in job.spec.tasks if t.name in wanted]
    return process_document(engines, job, task.ref, tasks=tasks, pages=pages, digest=task.digest)


# -- the driver -----------------------------------------------------------------

# A private local cluster only carries results of in-flight documents through
# its object store (workers read the documents themselves): keep it small.
_LOCAL_OBJECT_STORE_BYTES = 200 * 2**20


def run_job_on_ray(job: Any, **options: Any) -> Any:
    """``run_job`` on Ray: same records, same checkpoint, same ``RunSummary``.

    ``options`` are :class:`RayRun`'s: ``address`` and ``workers`` override the
    job's ``engine:`` block (with no address a private local cluster of
    ``workers`` CPUs is started and shut down at the end); ``retry_failed``,
    ``pages`` and ``progress`` as in the local runner; ``setup``/``process``
    replace the model work inside the actors (tests only; see
    :class:`DocumentWorker`).
    """
    return RayRun(job, **options).run()


class RayRun:
    """One run of a job on Ray; ``stats`` keeps the dispatcher's numbers."""

    def __init__(
        self,
        job: Any,
        *,
        address: str | None = None,
        workers: int | None = None,
        retry_failed: bool = False,
        pages: str | None = None,
        progress: bool = True,
        num_cpus_per_worker: float = 1.0,
        ready_timeout_s: float = 600.0,
        setup: Callable[[Any], Any] | None = None,
        process: Callable[[Any, Any, Any, str | None], Iterable[dict]] | None = None,
        refs: Iterable[Any] | None = None,
    ):
        spec = job.spec.engine
        self.job = job
        self.address = address if address is not None else spec.address
        self.workers = workers if workers is not None else spec.workers
        self.max_retries = spec.max_retries
        self.per_worker = spec.max_in_flight_per_worker
        self.retry_failed = retry_failed
        self.pages = pages
        self.progress = progress
        self.num_cpus = num_cpus_per_worker
        self.ready_timeout_s = ready_timeout_s
        self.setup = setup
        self.process = process
        self.refs = refs
        self.stats: DispatchStats | None = None
        self.ready_s: float | None = None  # time until every actor had its model loaded

    def run(self) -> Any:
        from pipeline.output.results_log import ResultLog
        from pipeline.inputs.ingest import discover
        from pipeline.output.lock import JobLock
        from pipeline.run.progress import make_progress
        from pipeline.run.runner import RunSummary, with_pages

        # A --pages override is part of the job's context, hence of the keys,
        # exactly as in the local runner; workers then need no separate pages.
        self.job, self.pages = with_pages(self.job, self.pages), None
        refs = list(discover(self.job) if self.refs is None else self.refs)
        summary = RunSummary(documents=len(refs))
        job = self.job
        with JobLock(job.output_path, job=job.spec.name), ResultLog(job.output_path).open() as log:
            bar = make_progress(len(refs), "documents", "doc") if self.progress else None
            work = self._work(refs, log, summary, bar)
            first = next(work, None)
            started, dispatcher = False, None
            try:
                if first is None:  # all done already: like the local runner, load no model
                    return self._finish(summary)
                started = _connect(self.address, self.workers * self.num_cpus)
                dispatcher = Dispatcher(
                    self._actor_factory(), workers=self.workers,
                    max_in_flight_per_worker=self.per_worker, max_retries=self.max_retries,
                )
                self.stats = dispatcher.stats
                self._start(dispatcher)
                writer = _Writer(job, log, summary, bar, self.retry_failed)
                dispatcher.run(
                    itertools.chain([first], work),
                    on_result=writer.records,
                    on_error=lambda item, exc: writer.failure(item, _error(exc, "worker")),
                    on_give_up=lambda item: writer.failure(item, _died(item)),
                )
            finally:
                if bar is not None:
                    bar.close()
                _release(dispatcher, started)
        return self._finish(summary)

    def _finish(self, summary: Any) -> Any:
        logger.info(
            "%s on Ray (%d workers): %d documents, %d records written (%d ok, %d failed), "
            "%d already done, %d worker deaths",
            self.job.spec.name, self.workers, summary.documents, summary.records_written, summary.done,
            summary.failed, summary.skipped, self.stats.worker_deaths if self.stats else 0,
        )
        return summary

    def _actor_factory(self) -> Callable[[int], Any]:
        import ray

        remote = ray.remote(num_cpus=self.num_cpus, max_restarts=0)(DocumentWorker)
        job = ray.put(self.job)  # once, not once per (re)started actor
        return lambda index: remote.remote(job, pages=self.pages, setup=self.setup, process=self.process)

    def _start(self, dispatcher: Dispatcher) -> None:
        """Start the actors and wait until each has loaded its model, so a
        model that cannot load fails the run once, with its own message."""
        import time

        import ray

        from pipeline.errors import TqpipeError

        t0 = time.perf_counter()
        dispatcher.start()
        try:
            where = ray.get([s.actor.ready.remote() for s in dispatcher.slots], timeout=self.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TqpipeError(
                f"Ray: {self.workers} workers not ready after {self.ready_timeout_s:.0f} s "
                f"(cluster {self.address or 'local'}; each needs {self.num_cpus} CPU)"
            ) from None
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            # The creation task's traceback ends with the real error ("ModelLoadError: ...").
            cause = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise TqpipeError(f"Ray: a worker failed to start (loading the model): {cause}") from None
        self.ready_s = time.perf_counter() - t0
        logger.info("Ray: %d workers ready in %.1f s on %s", len(where), self.ready_s,
                    ", ".join(sorted({w["host"] for w in where})))

    def _work(self, refs: list, log: Any, summary: Any, bar: Any) -> Iterator[WorkItem]:
        """The documents still to do, lazily (one content hash at a time);
        the same skip rule as the local runner."""
        from pipeline.inputs.ingest import content_hash
        from pipeline.run.runner import task_keys

        tasks = self.job.spec.tasks
        for ref in refs:
            try:
                digest = content_hash(ref)
            except OSError:
                digest = None  # the worker records the read error, like the local runner
            keys: dict[str, str] = {}
            todo = list(tasks)
            if digest is not None:
                keys = task_keys(self.job, digest)
                todo = [t for t in tasks if not log.is_done(keys[t.name], include_failed=not self.retry_failed)]
                summary.failed += sum(1 for t in tasks if t not in todo and keys[t.name] in log.failed_keys)
            if not todo:
                summary.skipped += 1
                if bar is not None:
                    bar.update(1)
                continue
            names = tuple(t.name for t in todo)
            yield WorkItem(ref.doc_id, DocumentTask(ref, digest, names, tuple(keys[n] for n in names if n in keys)))


class _Writer:
    """The driver's side of a finished document: append its records, count."""

    def __init__(self, job: Any, log: Any, summary: Any, bar: Any, retry_failed: bool):
        self.job, self.log, self.summary, self.bar = job, log, summary, bar
        self.retry_failed = retry_failed

    def records(self, item: WorkItem, records: list[dict]) -> None:
        from pipeline.errors import TqpipeError

        task: DocumentTask = item.payload
        failed = False
        for record in records:
            key = record["key"]
            if task.keys and key not in task.keys:
                raise TqpipeError(
                    f"Ray: a worker returned record key {key} for {item.doc_id}, expected one of "
                    f"{list(task.keys)}; the workers run a different tqpipe version or settings than the driver"
                )
            if self.log.is_done(key, include_failed=not self.retry_failed):
                logger.warning("%s: record %s already written; not writing it twice", item.doc_id, key)
                continue
            self.log.append(record)
            self.summary.records_written += 1
            if record["status"] == "ok":
                self.summary.done += 1
            else:
                self.summary.failed += 1
                failed = True
                logger.warning("%s [%s]: %s", item.doc_id, record["task"], record["error"]["message"])
        self._finished(item, failed)

    def failure(self, item: WorkItem, error: dict) -> None:
        """Error records for every pending task of a document the workers could not finish."""
        from pipeline.schema.record import make_record
        from pipeline.run.runner import task_keys

        task: DocumentTask = item.payload
        digest = task.digest or "sha256:unreadable"
        keys = task_keys(self.job, digest)
        records = [
            make_record(
                job=self.job.spec.name, doc_id=item.doc_id, source=str(task.ref.source), content_hash=digest,
                task=name, config_hash=keys[name].rsplit("/", 1)[1], status="error", error=error,
            )
            for name in task.tasks
        ]
        self.records(item, records)

    def _finished(self, item: WorkItem, failed: bool) -> None:
        if failed:
            self.summary.failed_documents.append(item.doc_id)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(failed=len(self.summary.failed_documents))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _error(exc: BaseException, stage: str) -> dict:
    from pipeline.schema.record import error_info

    return error_info(exc, stage=stage)


def _died(item: WorkItem) -> dict:
    n = item.attempts
    return {
        "type": "WorkerDied",
        "message": f"{item.doc_id}: the Ray worker died {n} time{'s' if n != 1 else ''} while processing "
        f"this document (last: {item.errors[-1] if item.errors else 'unknown'})",
        "stage": "worker",
        "attempts": n,
    }


def _connect(address: str | None, cpus: float) -> bool:
    """Join ``address`` or start a private local cluster; True if we called ``ray.init``.

    An already-initialised Ray (a notebook, a test fixture) is used as is
    and left running.
    """
    import ray

    from pipeline.errors import TqpipeError

    if ray.is_initialized():
        return False
    quiet = dict(logging_level=logging.WARNING, log_to_driver=False)
    if address:
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise TqpipeError(f"Ray: cannot connect to cluster {address!r}: {_first_line(e)}") from None
        have = ray.cluster_resources().get("CPU", 0)
        if have < cpus:
            ray.shutdown()
            raise TqpipeError(
                f"Ray: cluster {address!r} has {have:g} CPUs, the job's workers need {cpus:g}; lower --workers"
            )
        return True
    ray.init(
        num_cpus=max(1, int(-(-cpus // 1))),
        include_dashboard=False,
        object_store_memory=_LOCAL_OBJECT_STORE_BYTES,
        **quiet,
    )
    return True


def _release(dispatcher: Dispatcher | None, started: bool) -> None:
    """Free our actors' CPUs at once (a shared cluster wants them back) and
    disconnect / stop only what this run started."""
    import ray

    for slot in dispatcher.slots if dispatcher is not None else []:
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:
            pass
    if started:
        ray.shutdown()


__all__ = ["DispatchStats", "Dispatcher", "DocumentTask", "DocumentWorker", "RayRun", "WorkItem", "run_job_on_ray"]
