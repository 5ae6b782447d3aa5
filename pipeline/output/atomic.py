"""Files written whole or not at all: an export or report replaces the old one only once complete.

The new content goes to a hidden sibling first and is renamed over the
target (``os.replace``, atomic within a folder), so a full disk or a kill
mid-write leaves the previous file as it was, never a truncated one.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable


def write_whole(out: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(path)`` on a temporary sibling of ``out``, then move it onto ``out``.

    The sibling is created with the usual permissions (the umask applies,
    as for a plain ``open``); it is removed if ``write`` fails.
    """
    tmp = out.with_name(f".{out.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        write(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
