"""Progress for humans on a terminal, log lines for cron.

A run from cron or a service writes to a log file: tqdm's carriage-return
redraws turn that into megabytes of noise.  So progress objects are tqdm bars
only when stderr is a terminal, and otherwise plain INFO log lines, at most
one every ``TQPIPE_PROGRESS_INTERVAL`` seconds (default 30) plus one at the
end, e.g. ``documents 3/10 (1 failed) 0.4/s eta 0:00:17``.

``TQPIPE_PROGRESS`` overrides the choice: ``bar`` (tqdm), ``log``, ``off``.
Both kinds share the tqdm subset the pipeline uses: ``update(n)``,
``set_postfix(**kw)``, ``reset(total)``, ``close()``, context manager.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Protocol

logger = logging.getLogger("pipeline.run.progress")

DEFAULT_INTERVAL_S = 30.0


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless n is 1 ("1 document", "3 documents"):
    log lines are read by people, and "1 tasks" reads as a bug."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


class ProgressLike(Protocol):
    n: int
    total: int | None

    def update(self, n: int = 1) -> Any: ...
    def set_postfix(self, **kw: Any) -> Any: ...
    def reset(self, total: int | None = None) -> Any: ...
    def close(self) -> None: ...
    def __enter__(self) -> "ProgressLike": ...
    def __exit__(self, *exc: Any) -> Any: ...


def _mode() -> str:
    mode = os.environ.get("TQPIPE_PROGRESS", "").strip().lower()
    if mode in ("bar", "tqdm"):
        return "bar"
    if mode in ("log", "off"):
        return mode
    try:
        return "bar" if sys.stderr.isatty() else "log"
    except (AttributeError, ValueError):  # no stderr (daemon) or a closed one
        return "log"


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("TQPIPE_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class LogProgress:
    """tqdm look-alike that reports through ``logging``, rate-limited.

    ``leave=False`` (tqdm: bar disappears when done; used for per-document
    prefill/decode bars) logs the final line at DEBUG, so a 1000-document
    log shows one line per document, not three.
    """

    def __init__(self, total: int | None, desc: str, unit: str = "it", *, leave: bool = True,
                 interval: float | None = None):
        self.total, self.desc, self.unit, self.leave = total, desc, unit, leave
        self.interval = _interval() if interval is None else interval
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self._start = self._last = time.monotonic()
        self._closed = False
        self._stopped = False  # left by an exception (a signal's Stopped): "0/3 done" would read as finished

    def line(self) -> str:
        """The current status line (also what gets logged)."""
        elapsed = time.monotonic() - self._start
        text = f"{self.desc} {self.n}" + (f"/{self.total}" if self.total is not None else f" {self.unit}")
        if self.postfix:
            # Counts read as "(1 failed)"; other values as "(doc=a.pdf)".
            text += " (" + ", ".join(
                f"{v} {k}" if isinstance(v, int) and not isinstance(v, bool) else f"{k}={v}"
                for k, v in self.postfix.items()
            ) + ")"
        if elapsed > 0 and self.n:
            rate = self.n / elapsed
            text += f" {rate:.3g} {self.unit}/s" if self.unit != "it" else f" {rate:.3g}/s"
            if self.total is not None and not self._closed and self.n < self.total:
                text += f" eta {_clock((self.total - self.n) / rate)}"
        if self._closed:
            text += f" {'stopped after' if self._stopped else 'done in'} {_clock(elapsed)}"
        return text

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            logger.info(self.line())

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kw: Any) -> None:
        self.postfix = {**(ordered_dict or {}), **kw}

    def reset(self, total: int | None = None) -> None:
        self.n, self.total = 0, total if total is not None else self.total
        self._start = self._last = time.monotonic()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        logger.log(logging.INFO if self.leave else logging.DEBUG, self.line())

    def __enter__(self) -> "LogProgress":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._stopped = exc_type is not None
        self.close()


class NullProgress(LogProgress):
    """``TQPIPE_PROGRESS=off``: counts, never reports."""

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        self._closed = True


def _width() -> dict[str, Any]:
    """tqdm's size: follow the terminal's, except where it reports 0 columns
    or rows (a pty opened without a size: docker exec, some CI runners),
    which tqdm takes literally: no room for text, every bar "hidden below
    the screen"."""
    try:
        columns, rows = os.get_terminal_size(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):
        columns, rows = 0, 0
    size: dict[str, Any] = {"dynamic_ncols": True} if columns > 0 else {"ncols": 80}
    if rows <= 0:
        size["nrows"] = 24
    return size


def make_progress(total: int | None, desc: str, unit: str = "it", *, position: int = 0,
                  leave: bool = True) -> ProgressLike:
    """A tqdm bar on a terminal, else a rate-limited log-line reporter."""
    mode = _mode()
    if mode == "bar":
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, position=position, leave=leave,
                    file=sys.stderr, **_width())
    if mode == "off":
        return NullProgress(total, desc, unit, leave=leave)
    return LogProgress(total, desc, unit, leave=leave)


class _TqdmHandler(logging.StreamHandler):
    """Writes log lines through ``tqdm.write`` so they don't tear live bars."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


_HANDLER_FLAG = "_tqpipe_handler"


def configure_logging(verbose: bool = False) -> None:
    """Log INFO (DEBUG with ``verbose``) to stderr with timestamps.

    Idempotent: calling it again replaces our handler instead of doubling
    every line.  Chatty libraries stay at WARNING even when verbose.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_FLAG, False):
            root.removeHandler(handler)
    handler: logging.Handler = _TqdmHandler() if _mode() == "bar" else logging.StreamHandler(sys.stderr)
    setattr(handler, _HANDLER_FLAG, True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("filelock", "urllib3", "PIL", "httpx", "huggingface_hub", "ray", "watchdog"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
