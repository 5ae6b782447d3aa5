"""On-disk cache for the models tqpipe builds itself.

Built-in models (the converted SmolLM2 and the seeded tiny VLM) are built once
and reused by every later process: tests, CLI runs and Ray workers on the same
machine.  Several of those may start at the same moment, so a build must never
be observed half-written:

* the directory is built in a temporary sibling and renamed into place, so a
  reader sees either nothing or a complete directory;
* a marker file, written last, records the builder's version, its source and
  the size of every file; a directory whose marker is missing, stale or whose
  files do not match (a crash, a truncated copy, a hand edit) is rebuilt;
* builders take a file lock, so a second process waits for the first and then
  uses its result instead of repeating the work.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

MARKER = ".tqpipe-model.json"


def tqpipe_home() -> Path:
    """``$TQPIPE_HOME``, else ``~/.cache/tqpipe``: the root of everything tqpipe keeps
    between runs (built models here, document caches in ``pipeline.inference.doc_cache``)."""
    home = os.environ.get("TQPIPE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "tqpipe"


def models_home() -> Path:
    """``$TQPIPE_HOME/models``, else ``~/.cache/tqpipe/models``."""
    return tqpipe_home() / "models"


def read_marker(path: Path) -> dict | None:
    """The build marker of ``path`` (``{"stamp": ..., "files": ...}``), None if absent or unreadable."""
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_valid(path: Path, stamp: dict[str, Any]) -> bool:
    """True if ``path`` holds a complete build whose marker matches ``stamp``."""
    marker = read_marker(path)
    if marker is None or marker.get("stamp") != stamp:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, size in files.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            return False
    return True


def write_marker(path: Path, stamp: dict[str, Any]) -> None:
    """Mark ``path`` as a complete build of ``stamp`` (every file's size, read back by :func:`is_valid`)."""
    files = {
        p.relative_to(path).as_posix(): p.stat().st_size
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != MARKER
    }
    if not files:
        raise RuntimeError(f"model build in {path} produced no files")
    (path / MARKER).write_text(json.dumps({"stamp": stamp, "files": files}, indent=1))


def _remove_leftovers(target: Path) -> None:
    """Delete build and stale folders a killed builder left next to ``target``.

    Only called under the build lock, and every builder holds that lock for
    as long as its folders exist, so whatever is there now is orphaned.
    """
    for pattern in (f".{target.name}.build-*", f".{target.name}.stale-*"):
        for leftover in target.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def cached_build(
    target: Path, stamp: dict[str, Any], build: Callable[[Path], None]
) -> Path:
    """Return ``target``, building it with ``build(tmp_dir)`` unless already valid.

    ``stamp`` identifies what the directory must contain (builder version,
    source file, seed...); a directory built from another stamp is replaced.
    """
    target = Path(target)
    if is_valid(target, stamp):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if is_valid(target, stamp):  # another process built it while we waited
            return target
        _remove_leftovers(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; others read the cache
            build(tmp)
            write_marker(tmp, stamp)
            if target.exists() or target.is_symlink():
                stale = Path(
                    tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent)
                )
                os.replace(target, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    if not is_valid(target, stamp):
        raise RuntimeError(f"model cache {target}: build finished but the result is invalid")
    return target
