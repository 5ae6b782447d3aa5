"""File names as text: for records, for log lines, and back to bytes.

On POSIX a file name is bytes.  Python hands names that are not valid UTF-8
(zip archives, SMB shares, old scanners) to us as ``str`` with lone
surrogates (PEP 383 ``surrogateescape``), which opens and stats fine but
which no JSON encoder accepts.  So every name that leaves the process goes
through here:

* :func:`path_text` - the name as text with each undecodable byte written
  as ``\\xNN`` (records: ``source``, ``doc_id``).  Readable, but ambiguous
  for a name that really contains ``\\xNN``, hence
* :func:`path_b64` - the raw bytes, standard base64, for records of names
  that are not valid UTF-8 only (``source_b64``); ``path_from_b64`` inverts it;
* :func:`shown` - the name for a message or a log line: as is when it is
  plain printable text, else quoted like a Python ``repr`` (``'a\\nb.pdf'``)
  so a newline in a name cannot split a log line and an odd name is visible.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any


def _raw(path: str | os.PathLike) -> bytes:
    return os.fsencode(path)


def text_safe(s: str) -> str:
    """``s`` with lone surrogates (undecodable bytes) written as ``\\xNN``; valid UTF-8 text."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        pass
    try:
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate outside the escape range: not from a file name
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def path_text(path: str | os.PathLike) -> str:
    """The name as text, undecodable bytes as ``\\xNN`` (see module docstring)."""
    return text_safe(os.fspath(path) if not isinstance(path, bytes) else os.fsdecode(path))


def is_text_name(path: str | os.PathLike) -> bool:
    """True when the name's bytes are valid UTF-8 (``path_text`` is then exact)."""
    try:
        _raw(path).decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def path_b64(path: str | os.PathLike) -> str | None:
    """Base64 of the name's raw bytes, or None when the name is valid UTF-8."""
    return None if is_text_name(path) else base64.b64encode(_raw(path)).decode("ascii")


def path_from_b64(value: str) -> Path:
    """The path a ``source_b64`` field names, usable with ``open``."""
    return Path(os.fsdecode(base64.b64decode(value)))


def shown(path: Any) -> str:
    """A name for messages and log lines: plain when printable, else quoted and escaped."""
    s = os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path)
    text = path_text(s)
    if text == s and s.isprintable():
        return s
    out = []
    for ch in s:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch == "\\" or ch == "'":
            out.append("\\" + ch)
        elif not ch.isprintable() or 0xD800 <= code <= 0xDFFF:
            out.append(repr(ch)[1:-1] if 0xD800 > code or code > 0xDFFF else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "'" + "".join(out) + "'"


def json_safe(obj: Any) -> Any:
    """``obj`` with every string made valid UTF-8 (:func:`text_safe`), recursively."""
    if isinstance(obj, str):
        return text_safe(obj)
    if isinstance(obj, os.PathLike):
        return path_text(obj)
    if isinstance(obj, dict):
        return {json_safe(k) if isinstance(k, str) else k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
