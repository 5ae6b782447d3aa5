"""Shared fixtures.  Importing turboquant first routes MLX's CPU BLAS to OpenBLAS."""

import turboquant  # noqa: F401  (must precede any mlx import)

import pytest

from fixtures_models import *  # noqa: E402,F401,F403  (session model fixtures)


@pytest.fixture(autouse=True, scope="session")
def _isolated_models_home(tqpipe_models_home):
    """No test builds into the user's real ~/.cache/tqpipe."""
    return tqpipe_models_home
