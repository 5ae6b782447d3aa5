"""Shared fixtures.  Importing turboquant first routes MLX's CPU BLAS to OpenBLAS."""

import turboquant  # noqa: F401  (must precede any mlx import)

import pytest

from fixtures_models import *  # noqa: E402,F401,F403  (session model fixtures)


@pytest.fixture(autouse=True, scope="session")
def _isolated_models_home(tqpipe_models_home):
    """No test builds into the user's real ~/.cache/tqpipe."""
    return tqpipe_models_home


@pytest.fixture(autouse=True)
def _isolated_doc_caches(tmp_path_factory, monkeypatch):
    """Each test starts with an empty document-cache store: a document cached
    by one test must not turn another test's prefill into a load."""
    root = tmp_path_factory.mktemp("doc-caches")
    monkeypatch.setattr("pipeline.inference.doc_cache.default_store_path", lambda: root)
    return root
