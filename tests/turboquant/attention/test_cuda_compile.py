"""Every CUDA kernel variant the launch table uses compiles for sm_90, on a machine without a GPU.

CI never has a GPU, so without this a CUDA syntax or resource error in a
kernel body would first show on a lent GPU.  NVRTC and the CUDA headers
come from PyPI wheels (nvidia-cuda-nvrtc, nvidia-cuda-runtime: ~60 MB,
fetched with ``pip download --no-deps`` unless ``NVRTC_LIB`` names a
library already); each case is compiled as the CUDA backend builds it
(``scripts/cuda_compile_check.py``).  Metal sources are not compiled
anywhere (no Mac).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
WHEELS = ("nvidia-cuda-nvrtc>=13,<14", "nvidia-cuda-runtime>=13,<14")


def _compile_check():
    spec = importlib.util.spec_from_file_location("cuda_compile_check", ROOT / "scripts" / "cuda_compile_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECK = _compile_check()


@pytest.fixture(scope="module")
def nvrtc_env(tmp_path_factory):
    """``NVRTC_LIB`` and ``CUDA_INCLUDE`` for the script: the caller's, or
    from the two wheels unpacked into a temporary folder."""
    if os.environ.get("NVRTC_LIB"):
        yield
        return
    root = tmp_path_factory.mktemp("nvrtc")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                           "-d", str(root), *WHEELS], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot fetch NVRTC from the package index: {done.stderr.strip()[-300:]}")
    for wheel in root.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root / "site")
    cu13 = root / "site" / "nvidia" / "cu13"
    lib = cu13 / "lib" / "libnvrtc.so.13"
    assert lib.is_file() and (cu13 / "include" / "cuda_fp16.h").is_file(), "the wheels' layout changed"
    saved = {k: os.environ.get(k) for k in ("NVRTC_LIB", "CUDA_INCLUDE")}
    os.environ["NVRTC_LIB"], os.environ["CUDA_INCLUDE"] = str(lib), str(cu13 / "include")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.parametrize("case", CHECK.CASES, ids=lambda c: f"{c[0]}[{','.join(f'{k}={v}' for k, v in c[3])}]")
def test_kernel_variant_compiles_for_sm_90(nvrtc_env, case):
    name, ins, outs, tmpl = case
    ok, log = CHECK.compile_cuda(CHECK.case_source(name, ins, outs, dict(tmpl)), name)
    assert ok, log
    assert "registers" in log  # ptxas ran on it (the resource report), not just the front end
