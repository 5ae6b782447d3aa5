"""SIGTERM and SIGINT: stop cleanly, say so, and exit 128 + the signal number.

cron, systemd and container runtimes stop a job with SIGTERM; a person with
Ctrl-C (SIGINT).  Either way the run must not die where it stands: the
signal is turned into :class:`Stopped` (a ``KeyboardInterrupt``, so every
``finally`` runs and no ``except Exception`` swallows it).  The record in
flight is abandoned - a half-written line is rolled back by
:class:`~pipeline.output.results_log.ResultLog` - the job's lock is
released by its context manager, and the CLI prints one line and exits 143
(SIGTERM) or 130 (SIGINT), the codes shells and systemd use for "killed by
that signal".  A second signal while stopping is ignored, so cleanup is not
cut short.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """Raised in the main thread when a stop signal arrives; ``exit_code`` is 128 + signum."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)


def stopped_from(exc: KeyboardInterrupt) -> Stopped:
    """``exc`` as a :class:`Stopped` (a plain KeyboardInterrupt is a SIGINT)."""
    return exc if isinstance(exc, Stopped) else Stopped(signal.SIGINT)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise :class:`Stopped` once.

    Outside the main thread (where Python cannot install handlers) the
    block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    state = {"stopping": False}

    def handler(signum: int, frame) -> None:
        if state["stopping"]:
            return  # already unwinding: let the cleanup finish
        state["stopping"] = True
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
