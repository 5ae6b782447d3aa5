"""Route MLX's CPU matrix products through OpenBLAS when one is on the machine.

MLX's Linux CPU wheel links the reference (netlib) BLAS, which multiplies
float32 matrices at ~5 GFLOP/s on the CI machines; OpenBLAS does the same
products at ~200 GFLOP/s.  Loading an OpenBLAS with ``RTLD_GLOBAL`` *before*
``mlx.core`` is imported puts its ``sgemm_`` first in the symbol search order,
so MLX's calls land there without relinking anything.  Nothing changes on
macOS (Accelerate) or when no OpenBLAS is found; ``TQ_OPENBLAS=off`` disables
it and ``TQ_OPENBLAS=/path/libopenblas.so`` picks a specific library.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import sysconfig

_loaded: str | None = None


def _candidates() -> list[str]:
    explicit = os.environ.get("TQ_OPENBLAS", "")
    if explicit and explicit != "off":
        return [explicit]
    found: list[str] = []
    purelib = sysconfig.get_paths()["purelib"]
    # opencv-python (mlx-vlm's) and opencv-python-headless (rapidocr's, so every
    # install) bundle a full OpenBLAS with unprefixed symbols; system packages
    # are the fallback.
    for wheel in ("opencv_python.libs", "opencv_python_headless.libs"):
        found += sorted(glob.glob(os.path.join(purelib, wheel, "libopenblas*.so*")))
    found += sorted(glob.glob("/usr/lib/x86_64-linux-gnu/libopenblas*.so*"))
    found += sorted(glob.glob("/usr/lib/aarch64-linux-gnu/libopenblas*.so*"))
    return found


def enable_fast_cpu_blas() -> str | None:
    """Preload OpenBLAS globally; returns its path, or None if not used."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if not sys.platform.startswith("linux") or os.environ.get("TQ_OPENBLAS") == "off":
        return None
    if "mlx.core" in sys.modules:
        return None  # too late: MLX resolved its BLAS symbols at import
    for path in _candidates():
        try:
            ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
        except OSError:
            continue
        _loaded = path
        return path
    return None
