"""Session-scoped fixtures for the built-in models.

Import them into a conftest or test module (``from fixtures_models import *``).
Everything lives in one directory under pytest's base temp dir, which
``TQPIPE_HOME`` points at for the rest of the session, so
``load_model(None)`` in any later test finds the same cached builds; if these
fixtures are registered twice (conftest and a test module) the second set
finds the first one's cache instead of rebuilding.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import pipeline  # noqa: F401  (fast CPU BLAS before mlx.core)
from pipeline.models.load import LoadedModel, builtin_text_model_dir, builtin_vlm_dir, load_model, models_home

__all__ = ["tqpipe_models_home", "smollm2_dir", "tiny_vlm_dir", "smollm2_model", "tiny_vlm_model"]

# Loaded once per process even if the fixtures are registered in several
# modules (each registration would otherwise get its own session instance).
_LOADED: dict[bool, LoadedModel] = {}


def _load_builtin(needs_images: bool) -> LoadedModel:
    if needs_images not in _LOADED:
        _LOADED[needs_images] = load_model(None, needs_images=needs_images)
    return _LOADED[needs_images]


@pytest.fixture(scope="session")
def tqpipe_models_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Point ``TQPIPE_HOME`` at a per-session temp dir; returns its models dir."""
    home = tmp_path_factory.getbasetemp() / "tqpipe-home"
    old = os.environ.get("TQPIPE_HOME")
    os.environ["TQPIPE_HOME"] = str(home)
    yield models_home()
    if old is None:
        os.environ.pop("TQPIPE_HOME", None)
    else:
        os.environ["TQPIPE_HOME"] = old


@pytest.fixture(scope="session")
def smollm2_dir(tqpipe_models_home: Path) -> Path:
    """SmolLM2-135M-Instruct converted to an mlx-lm directory (4-bit, as in the GGUF)."""
    return builtin_text_model_dir()


@pytest.fixture(scope="session")
def tiny_vlm_dir(tqpipe_models_home: Path) -> Path:
    """The seeded tiny Qwen2-VL directory (seed 0)."""
    return builtin_vlm_dir()


@pytest.fixture(scope="session")
def smollm2_model(smollm2_dir: Path) -> LoadedModel:
    """``load_model(None)``: SmolLM2, float32 on CPU.  Shared: do not mutate."""
    return _load_builtin(False)


@pytest.fixture(scope="session")
def tiny_vlm_model(tiny_vlm_dir: Path) -> LoadedModel:
    """``load_model(None, needs_images=True)``: the tiny VLM.  Shared: do not mutate."""
    return _load_builtin(True)
