import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from turboquant.codebooks import committed_tables
from turboquant.codebooks import codebook, lloyd_max

DIMS = [64, 80, 96, 128, 256]
# Lloyd-Max for N(0,1) (Max 1960), the d -> inf limit; the paper rounds these
# to 0.36, 0.117, 0.03, 0.009.
GAUSS_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}
PAPER_MSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}


def _density(d):
    x = np.linspace(-1, 1, 2_000_001)
    with np.errstate(divide="ignore"):
        f = np.exp(0.5 * (d - 3) * np.log1p(-x * x))
    return x, f / np.trapezoid(f, x)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_lloyd_max_conditions_independent_integration(dim):
    x, f = _density(dim)
    for bits in (1, 2, 3, 4):
        cb = codebook(bits, dim)
        c, b = np.array(cb.centroids), np.array(cb.boundaries)
        assert len(c) == 2**bits and len(b) == 2**bits - 1 and np.all(np.diff(c) > 0)
        np.testing.assert_allclose(b, 0.5 * (c[1:] + c[:-1]), rtol=0, atol=1e-15)
        edges = np.concatenate([[-1.0], b, [1.0]])
        cell = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(c) - 1)
        for i in range(len(c)):
            m = cell == i
            cond_mean = np.trapezoid(x[m] * f[m], x[m]) / np.trapezoid(f[m], x[m])
            assert abs(cond_mean - c[i]) < 2e-5 / np.sqrt(dim)
        per_coord = np.trapezoid((x - c[cell]) ** 2 * f, x)
        assert abs(dim * per_coord - cb.mse) < 2e-3 * cb.mse


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_mse_matches_paper(bits):
    for dim in (128, 256):
        mse = codebook(bits, dim).mse
        assert abs(mse - GAUSS_MSE[bits]) < 0.03 * GAUSS_MSE[bits]
        # and the paper's rounded figures at their printed precision
        digits = {1: 2, 2: 3, 3: 2, 4: 3}[bits]
        if dim == 256:
            assert round(mse, digits) == PAPER_MSE[bits]
        assert mse > 4.0**-bits  # Shannon lower bound
    # finite d is slightly better than the Gaussian limit, and approaches it
    assert codebook(bits, 64).mse < codebook(bits, 128).mse < codebook(bits, 256).mse


def test_monte_carlo_unit_vectors():
    rng = np.random.default_rng(0)
    d = 128
    u = rng.standard_normal((20000, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    for bits in (1, 2, 3, 4):
        cb = codebook(bits, d)
        idx = np.searchsorted(np.array(cb.boundaries), u)
        err = ((u - np.array(cb.centroids)[idx]) ** 2).sum(axis=1).mean()
        assert abs(err - cb.mse) < 0.02 * cb.mse


def test_tables_cover_head_dims_and_match_routine():
    for d in DIMS:
        for b in (1, 2, 3, 4):
            assert (b, d) in committed_tables()
    fresh = lloyd_max(3, 80)
    np.testing.assert_allclose(fresh.centroids, codebook(3, 80).centroids, rtol=1e-12)


def test_runtime_dim_not_in_table():
    cb = codebook(2, 100)
    assert (2, 100) not in committed_tables() and len(cb.centroids) == 4
    assert 0.11 < cb.mse < 0.118
    c = cb.centroids_mx()
    assert c.dtype.size == 4 and c.shape == (4,)


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        codebook(0, 128)
    with pytest.raises(ValueError, match="dim"):
        codebook(2, 2)


def test_generator_script_reproduces_committed_tables():
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, str(root / "scripts" / "gen_codebooks.py"), "--check"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
