"""The Ray engine: documents spread over a cluster, one loaded model per actor.

``tqpipe run JOB --engine ray`` uses Ray (an existing, well-tested distributed
engine) instead of a home-made scheduler.  The shape is chosen for the three
promises the local engine already makes:

* **One prefill per document.**  Each ``DocumentWorker`` actor loads the model
  once and processes WHOLE documents through the local runner's
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
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from pipeline.run.dispatch import DispatchStats, Dispatcher, WorkItem, first_line
from pipeline.run.progress import counted
from pipeline.schema.paths import shown, text_safe

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class DocumentTask:
    """What a worker needs for one document (pickled to it).

    ``keys`` are the record keys the driver expects back: a worker whose
    tqpipe computes different keys (another version) is caught at once
    instead of silently breaking exactly-once.
    """

    ref: Any  # pipeline.inputs.discover.DocumentRef
    digest: str | None  # content hash, None when the driver could not read the file
    tasks: tuple[str, ...]
    keys: tuple[str, ...] = ()


class DocumentWorker:
    """The body of one Ray actor: a loaded model that processes whole documents.

    ``setup(job)`` runs once per actor: by default it builds the job's
    ``Engines`` and loads the job's model now (the built-in text model for a
    job without one; the built-in VLM loads on the first document with page
    images), so load errors show up before any document is handed out.
    ``process(state, job, task)`` returns the records of one document, by
    default through :func:`pipeline.run.document.process_document`.  Tests inject
    cheap fakes through these two parameters - the only seam.  The actor
    writes nothing: records go back to the driver.
    """

    def __init__(
        self,
        job: Any,
        *,
        setup: Callable[[Any], Any] | None = None,
        process: Callable[[Any, Any, Any], Iterable[dict]] | None = None,
        device: str | None = None,
    ):
        import socket

        if device is not None:  # before any model loads: the GPU Ray gave us, or the CPU
            from pipeline.run.ray_resources import pin_device

            pin_device(device)
        self.job = job
        self.where = {"host": socket.gethostname(), "pid": os.getpid(), "device": device or "default"}
        self._process = process or _process_document
        self.state = (setup or _load_engines)(job)

    def ready(self) -> dict:
        """Returns once the model is loaded: where this worker runs."""
        return self.where

    def pid(self) -> int:
        return os.getpid()

    def process(self, task: Any) -> list[dict]:
        """The records of one document, tagged with the worker that made them."""
        records = list(self._process(self.state, self.job, task))
        for record in records:
            record["worker"] = self.where
        return records


def _load_engines(job: Any) -> Any:
    from pipeline.inference.engines import Engines

    engines = Engines(job)
    engines.get(needs_images=False)
    return engines


def _process_document(engines: Any, job: Any, task: DocumentTask) -> Iterator[dict]:
    from pipeline.run.document import process_document

    wanted = set(task.tasks)
    tasks = [t for t in job.spec.tasks if t.name in wanted]
    return process_document(engines, job, task.ref, tasks=tasks, digest=task.digest)


# -- the driver -----------------------------------------------------------------

# A private local cluster only carries results of in-flight documents through
# its object store (workers read the documents themselves): keep it small.
_LOCAL_OBJECT_STORE_BYTES = 200 * 2**20


def run_job_on_ray(job: Any, **options: Any) -> Any:
    """``run_job`` on Ray: same records, same checkpoint, same ``RunSummary``.

    ``options`` are :class:`RayRun`'s: ``address`` and ``workers`` override the
    job's ``engine:`` block (with no address a private local cluster of
    ``workers`` CPUs is started and shut down at the end); ``retry_failed``
    and ``progress`` as in the local runner (a ``--pages`` override is
    already in ``job``); ``setup``/``process``
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
        progress: bool = True,
        num_cpus_per_worker: float = 1.0,
        ready_timeout_s: float = 600.0,
        setup: Callable[[Any], Any] | None = None,
        process: Callable[[Any, Any, Any], Iterable[dict]] | None = None,
        refs: Iterable[Any] | None = None,
    ):
        spec = job.spec.engine
        self.job = job
        self.address = address if address is not None else spec.address
        self.workers_asked = workers if workers is not None else spec.workers  # None: one per GPU
        self.gpus_per_worker = spec.gpus_per_worker
        self.plan: Any = None  # ray_resources.ActorPlan, once connected
        self.workers = self.workers_asked or 0
        self.max_retries = spec.max_retries
        self.per_worker = spec.max_in_flight_per_worker
        self.retry_failed = retry_failed
        self.progress = progress
        self.num_cpus = num_cpus_per_worker
        self.ready_timeout_s = ready_timeout_s
        self.setup = setup
        self.process = process
        self.refs = refs
        self.stats: DispatchStats | None = None
        self.ready_s: float | None = None  # time until every actor had its model loaded

    def run(self) -> Any:
        """Plan, dispatch to the actors, append what they return; a ``RunSummary``."""
        from pipeline.inputs.discover import discover
        from pipeline.output.lock import JobLock
        from pipeline.output.results_log import ResultLog
        from pipeline.run.progress import make_progress
        from pipeline.run.runner import RunSummary

        refs = list(discover(self.job) if self.refs is None else self.refs)
        summary = RunSummary(documents=len(refs), strict=self.job.spec.strict)
        job = self.job
        with JobLock(job.output_path, job=job.spec.name), ResultLog(job.output_path).open() as log, \
                (make_progress(len(refs), "documents", "doc") if self.progress else nullcontext()) as bar:
            from pipeline.run.runner import SameContent

            self._same: list = []  # second names of one content: copied once their originals are written
            work = self._work(refs, log, summary, bar)
            first = next(work, None)
            started, dispatcher = False, None
            try:
                if first is None:  # all done already: like the local runner, load no model
                    self._copy_same(SameContent(log), summary, bar)
                    return self._finish(summary)
                started = _connect(self.address, self.workers_asked, self.num_cpus)
                self.plan = _plan(self.address, self.workers_asked, self.gpus_per_worker, self.num_cpus)
                self.workers = self.plan.workers
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
                    on_error=writer.error,
                    on_give_up=lambda item: writer.failure(item, _died(item)),
                )
                self._copy_same(SameContent(log), summary, bar)
            finally:
                _release(dispatcher, started)
        return self._finish(summary)

    def _copy_same(self, originals: Any, summary: Any, bar: Any) -> None:
        for work in self._same:
            originals.write(self.job, work, summary)
            if bar is not None:
                bar.update(1)

    def _finish(self, summary: Any) -> Any:
        logger.info(
            "%s on Ray (%s): %s, %s written (%d ok, %d failed), %d already done, %s",
            self.job.spec.name, counted(self.workers, "worker"), counted(summary.documents, "document"),
            counted(summary.records_written, "record"), summary.done, summary.failed_now, summary.skipped,
            counted(self.stats.worker_deaths if self.stats else 0, "worker death"),
        )
        return summary

    def _actor_factory(self) -> Callable[[int], Any]:
        """Actor ``index`` with its plan's resources (a restart keeps its index)."""
        import ray

        plan = self.plan
        kinds = {}  # one remote class per resource shape
        job = ray.put(self.job)  # once, not once per (re)started actor

        def make(index: int) -> Any:
            res = plan.resources(index)
            key = (res["num_cpus"], res["num_gpus"])
            if key not in kinds:
                kinds[key] = ray.remote(max_restarts=0, **res)(DocumentWorker)
            return kinds[key].remote(job, setup=self.setup, process=self.process, device=plan.device(index))

        return make

    def _start(self, dispatcher: Dispatcher) -> None:
        """Start the actors and wait until each has loaded its model, so a
        model that cannot load fails the run once, with its own message."""
        import time

        import ray

        from pipeline.errors import RunError, TqpipeError

        t0 = time.perf_counter()
        dispatcher.start()
        try:
            where = ray.get([s.actor.ready.remote() for s in dispatcher.slots], timeout=self.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TqpipeError(
                f"Ray: {self.workers} workers not ready after {self.ready_timeout_s:.0f} s "
                f"(cluster {self.address or 'local'}; {self.plan.describe()}, {self.num_cpus:g} CPU each)"
            ) from None
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            # The creation task's traceback ends with the real error ("ModelLoadError: ...").
            cause = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise RunError(f"Ray: a worker failed to start (loading the model): {cause}") from None
        self.ready_s = time.perf_counter() - t0
        logger.info("Ray: %d workers (%s) ready in %.1f s on %s", len(where), self.plan.describe(), self.ready_s,
                    ", ".join(sorted({w["host"] for w in where})))

    def _work(self, refs: list, log: Any, summary: Any, bar: Any) -> Iterator[WorkItem]:
        """The documents still to do, lazily (one content hash at a time),
        by the same work plan as the local runner."""
        from pipeline.run.plan import WorkPlan

        plan = WorkPlan(self.job, retry_failed=self.retry_failed, documents=refs if self.refs is None else None)
        for ref in refs:
            work = plan.document(ref, log)
            summary.count_before(work)
            if not work.tasks:
                summary.skipped += 1
                if bar is not None:
                    bar.update(1)
                continue
            if work.same_as is not None:
                self._same.append(work)
                continue
            names = tuple(t.name for t in work.tasks)
            keys = tuple(work.keys[n] for n in names if n in work.keys)
            yield WorkItem(ref.doc_id, DocumentTask(ref, work.digest, names, keys))


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
            if self.summary.count(record):
                failed = True
                logger.warning("%s [%s]: %s", shown(item.doc_id), record["task"], record["error"]["message"])
        self._finished(item, failed)

    def error(self, item: WorkItem, exc: BaseException) -> None:
        """A document's processing raised on the worker: its error records, unless
        the run itself cannot go on (a model that does not load), which stops the run."""
        from pipeline.errors import RunError

        if isinstance(exc, RunError):
            raise exc
        self.failure(item, _error(exc, "worker"))

    def failure(self, item: WorkItem, error: dict) -> None:
        """Error records for every pending task of a document the workers could not finish."""
        from pipeline.output.render import error_records
        from pipeline.run.plan import task_keys

        from pipeline.inputs.discover import unreadable_digest

        task: DocumentTask = item.payload
        digest = task.digest or unreadable_digest(task.ref)
        records = list(error_records(self.job, task.ref, digest, task.tasks, task_keys(self.job, digest), error))
        self.records(item, records)

    def _finished(self, item: WorkItem, failed: bool) -> None:
        if failed:
            self.summary.failed_documents.append(text_safe(item.doc_id))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(failed=len(self.summary.failed_documents))


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


def _connect(address: str | None, workers: int | None, cpus_per_worker: float) -> bool:
    """Join ``address`` or start a private local cluster; True if we called ``ray.init``.

    A private cluster gets this machine's GPUs and enough CPUs for the
    actors the plan will ask for (``workers``, or one per GPU, or the
    default CPU actors).  An already-initialised Ray (a notebook, a test
    fixture) is used as is and left running.
    """
    import ray

    from pipeline.errors import TqpipeError
    from pipeline.run.ray_resources import DEFAULT_CPU_WORKERS, local_gpus

    if ray.is_initialized():
        return False
    quiet = dict(logging_level=logging.WARNING, log_to_driver=False)
    if address:
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise TqpipeError(f"Ray: cannot connect to cluster {address!r}: {first_line(e)}") from None
        return True
    gpus = local_gpus()
    actors = workers or max(gpus, DEFAULT_CPU_WORKERS if not gpus else 0)
    ray.init(
        num_cpus=max(1, int(-(-(actors * cpus_per_worker) // 1))),
        num_gpus=gpus,
        include_dashboard=False,
        object_store_memory=_LOCAL_OBJECT_STORE_BYTES,
        **quiet,
    )
    return True


def _plan(address: str | None, workers: int | None, gpus_per_worker: float | None, cpus_per_worker: float) -> Any:
    """The actor plan for the connected cluster's GPUs; stops early (and
    disconnects) when its CPUs cannot hold the actors."""
    import ray

    from pipeline.errors import TqpipeError
    from pipeline.run.ray_resources import plan_actors

    have = ray.cluster_resources()
    try:
        plan = plan_actors(have.get("GPU", 0), workers, gpus_per_worker, cpus_per_worker)
    except ValueError as e:
        raise TqpipeError(f"Ray: cluster {address or 'local'}: {e}") from None
    cpus = plan.workers * cpus_per_worker
    if have.get("CPU", 0) < cpus:
        raise TqpipeError(
            f"Ray: cluster {address or 'local'!r} has {have.get('CPU', 0):g} CPUs, the job's workers need "
            f"{cpus:g} ({plan.describe()}); lower --workers"
        )
    return plan


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
