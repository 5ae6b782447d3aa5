"""What ``model.path`` (or ``--model``) may name, decided without loading anything.

A built-in name, an existing local folder, or a Hugging Face Hub id
(``org/name``).  The job file, the command-line overrides and the loader
all ask :func:`model_path_problem`, so a path is refused the same way (and
with the same exit code) wherever it is given.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

BUILTIN_TEXT = "builtin:smollm2-135m-instruct"
BUILTIN_VLM = "builtin:tiny-qwen2-vl"
BUILTINS = (BUILTIN_TEXT, BUILTIN_VLM)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: str) -> bool:
    """``org/name``: not a path that starts at ``/``, ``.`` or ``~``."""
    return bool(_HUB_ID.match(path)) and not path.startswith((".", "~"))


def model_path_problem(path: str, local: Path) -> str | None:
    """Why ``path`` (found at ``local`` if it is a folder) names no model, or None.

    Nothing is read: whether a folder holds a model, or a Hub id exists
    (which may need the network), is the loader's to find out."""
    if path.startswith("builtin:"):
        return None if path in BUILTINS else f"unknown built-in model {path!r}; known: {', '.join(BUILTINS)}"
    if local.exists() or is_hub_id(path):  # a folder's contents are the loader's to check
        return None
    return (f"local model folder {str(local)!r} does not exist, and {path!r} is neither a hub id (org/name) "
            f"nor a built-in model ({', '.join(BUILTINS)})")


def command_line_model(value: str, cwd: Path) -> str:
    """``--model VALUE`` as ``model.path``: a folder relative to ``cwd`` (the
    working directory, not the job's) made absolute, anything else as given.
    Raises ValueError with :func:`model_path_problem`'s reason."""
    local = cwd / Path(value).expanduser()  # ~ and absolute paths are kept by the join
    problem = model_path_problem(value, local)
    if problem:
        raise ValueError(problem)
    return os.path.abspath(local) if local.exists() and not value.startswith("builtin:") else value

