"""Bounded, retrying distribution of work items over replaceable Ray actors.

Kept free of pipeline concerns (files, records) so its guarantees - the
in-flight bound, lazy pulling, charging a worker death to the right
document - can be tested on their own.  :mod:`pipeline.run.ray_engine`
puts documents through it.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from pipeline.run.progress import counted

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

        message = first_line(exc)
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
            logger.warning("worker %d died with %s queued (%s); retrying each alone: %s",
                           slot.index, counted(len(victims), "document"), ", ".join(v.doc_id for v in victims), message)
        for item in reversed(victims):
            item.suspect = True
            retry.appendleft(item)
            self.stats.resubmitted += 1


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (Ray errors carry whole tracebacks)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
