"""Peak memory of one document, for its records.

MLX's peak is reset before each document (:func:`reset_peak_memory`), so a
record's ``mx_peak_bytes`` is that document's own working set: weights,
cache, prefill temporaries.  The process max RSS never resets: it includes
earlier documents and everything Python holds.
"""

from __future__ import annotations

import resource
import sys


def max_rss_bytes() -> int:
    """This process's peak resident set size so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def reset_peak_memory() -> None:
    """Start a document's MLX peak from zero."""
    import mlx.core as mx

    mx.reset_peak_memory()


def memory_record() -> dict:
    """The ``memory`` field of a record: MLX peak since the document started, process max RSS."""
    import mlx.core as mx

    return {"mx_peak_bytes": int(mx.get_peak_memory()), "max_rss_bytes": max_rss_bytes()}
