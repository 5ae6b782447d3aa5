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
    the worker deaths charged to this document.
    """

    doc_id: str
    payload: Any
    attempts: int = 0
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


class Dispatcher:
    """Bounded, retrying distribution of ``WorkItem``s over replaceable actors.

    Kept free of pipeline concerns (files, records) so its guarantees - the
    in-flight bound, lazy pulling, charging a death to the right document - can
    be tested on their own.

    ``make_actor(index)`` creates an actor whose ``process.remote(payload)``
    returns the document's result.  Calls to one actor run in submission order
    (Ray guarantees this for a single caller and a non-async actor), so when an
    actor dies the OLDEST of its outstanding calls is the one that was running:
    only that document is charged an attempt; the ones queued behind it are
    resubmitted for free.
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
        retried); ``on_give_up`` an item whose workers died
        ``max_retries + 1`` times.  Callbacks run on the driver, one at a
        time, right after each document finishes.
        """
        import ray

        lost = tuple(getattr(ray.exceptions, name) for name in _LOST_WORKER_ERRORS)
        self.start()
        source = iter(source)
        retry: deque[WorkItem] = deque()
        pending: dict[Any, tuple[_Slot, WorkItem]] = {}
        exhausted = False
        stats = self.stats

        while True:
            while not exhausted or retry:
                slot = min(self.slots, key=lambda s: len(s.queue))
                if len(slot.queue) >= self.per_worker:
                    break
                if retry:
                    item = retry.popleft()
                else:
                    item = next(source, None)
                    if item is None:
                        exhausted = True
                        break
                obj = slot.actor.process.remote(item.payload)
                slot.queue.append(obj)
                pending[obj] = (slot, item)
                stats.submitted += 1
                stats.max_in_flight = max(stats.max_in_flight, len(pending))
                stats.max_outstanding = max(stats.max_outstanding, len(pending) + len(retry))
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
            stats.completed += 1
            if error is None:
                on_result(item, result)
            else:
                on_error(item, error)

    def _worker_lost(self, slot: _Slot, exc: BaseException, pending: dict, retry: deque, on_give_up) -> None:
        """Charge the running document, requeue the rest, replace the actor."""
        import ray

        text = str(exc).strip()
        message = text.splitlines()[0] if text else type(exc).__name__
        # The actor's queue is FIFO: its oldest outstanding call is the one it
        # was running when it died; the others never started.
        running, *innocent = [pending.pop(o)[1] for o in slot.queue]
        slot.queue.clear()
        self.stats.worker_deaths += 1
        logger.warning(
            "worker %d died while processing %s (attempt %d of %d): %s",
            slot.index, running.doc_id, running.attempts + 1, self.max_retries + 1, message,
        )
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:  # already gone
            pass
        slot.actor = self.make_actor(slot.index)

        running.attempts += 1
        running.errors.append(message)
        for other in reversed(innocent):
            retry.appendleft(other)
            self.stats.resubmitted += 1
        if running.attempts > self.max_retries:
            self.stats.completed += 1
            self.stats.gave_up += 1
            on_give_up(running)
        else:
            retry.appendleft(running)
            self.stats.resubmitted += 1


class DocumentWorker:
    """The body of one Ray actor: a loaded model that processes whole documents.

    ``setup(job)`` runs once per actor (loading the model is the expensive
    part); ``process(state, job, payload, pages)`` returns the records of one
    document.  Both default to the runner's code; tests inject cheap fakes
    through these two parameters - the only seam.  The actor writes nothing:
    records go back to the driver.
    """

    def __init__(
        self,
        job: Any,
        *,
        pages: str | None = None,
        setup: Callable[[Any], Any] | None = None,
        process: Callable[[Any, Any, Any, str | None], Iterable[dict]] | None = None,
    ):
        self.job = job
        self.pages = pages
        self._process = process or _process_document
        self.state = (setup or _load_engine)(job)

    def ready(self) -> dict:
        """Returns once the model is loaded; who and where this worker is."""
        import socket

        return {"pid": os.getpid(), "host": socket.gethostname()}

    def pid(self) -> int:
        return os.getpid()

    def process(self, payload: Any) -> list[dict]:
        return list(self._process(self.state, self.job, payload, self.pages))


def _load_engine(job: Any) -> Any:
    raise NotImplementedError


def _process_document(engine: Any, job: Any, payload: Any, pages: str | None) -> Iterator[dict]:
    raise NotImplementedError
