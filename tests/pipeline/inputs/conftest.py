"""Fixtures shared by the inputs tests."""

from pathlib import Path

import pytest

from pipeline.inputs.samples import write_samples


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    """The shipped sample documents, written once per test module."""
    d = tmp_path_factory.mktemp("samples")
    write_samples(d)
    return d
