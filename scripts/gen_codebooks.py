"""Regenerate turboquant/codebook_tables.json (Lloyd-Max codebooks).

    python scripts/gen_codebooks.py            # write the tables
    python scripts/gen_codebooks.py --check    # fail if the committed file differs

The tables come from ``turboquant.codebooks.lloyd_max`` (numpy); when scipy
is installed every centroid is also checked against an independent adaptive
quadrature (``scipy.integrate.quad``) of the exact density, so a bug in the
grid integration cannot slip into the constants.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from turboquant.codebooks import lloyd_max  # noqa: E402

DIMS = (64, 80, 96, 128, 256)
BITS = (1, 2, 3, 4)
OUT = ROOT / "turboquant" / "codebook_tables.json"


def _scipy_check(cb) -> None:
    try:
        from scipy import integrate
    except ImportError:
        return
    d = cb.dim
    f = lambda x: np.exp(0.5 * (d - 3) * np.log1p(-x * x))  # noqa: E731  unnormalised
    edges = (-1.0, *cb.boundaries, 1.0)
    for i, c in enumerate(cb.centroids):
        lo, hi = edges[i], edges[i + 1]
        p = integrate.quad(f, lo, hi, epsabs=0, epsrel=1e-12, limit=500)[0]
        m = integrate.quad(lambda x: x * f(x), lo, hi, epsabs=0, epsrel=1e-12, limit=500)[0]
        if abs(m / p - c) > 1e-9 / np.sqrt(d):
            raise SystemExit(f"gen_codebooks: b={cb.bits} d={d} centroid {i}: {c} != {m / p}")


def render() -> str:
    """The tables as JSON data: one entry per (bits, dim), numbers as Python's repr (exact round trip)."""
    import json

    tables = []
    for d in DIMS:
        for b in BITS:
            cb = lloyd_max(b, d)
            _scipy_check(cb)
            tables.append({"bits": b, "dim": d, "centroids": list(cb.centroids),
                           "boundaries": list(cb.boundaries), "mse": cb.mse})
    doc = {"generated_by": "scripts/gen_codebooks.py (do not edit)",
           "meaning": "per (bits, dim): centroids (ascending), boundaries, per-vector MSE of unit vectors",
           "tables": tables}
    return json.dumps(doc, indent=1) + "\n"


def _same_tables(old: str, new: str) -> bool:
    """Same entries and numbers equal to 1e-12 relative.

    The last digit of a Lloyd-Max iterate depends on the numpy/BLAS build
    (summation order), so an exact text match failed on a fresh install
    with identical code; 1e-12 is still far below anything that matters.
    """
    import json

    a, b = json.loads(old)["tables"], json.loads(new)["tables"]
    if [(t["bits"], t["dim"]) for t in a] != [(t["bits"], t["dim"]) for t in b]:
        return False

    def numbers(tables):
        return np.array([v for t in tables for v in (*t["centroids"], *t["boundaries"], t["mse"])])

    x, y = numbers(a), numbers(b)
    return x.shape == y.shape and bool(np.allclose(x, y, rtol=1e-12, atol=1e-15))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare with the committed file")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not _same_tables(OUT.read_text(), text):
            raise SystemExit(f"{OUT} is stale: run python scripts/gen_codebooks.py")
        print(f"{OUT} is up to date")
        return
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(DIMS) * len(BITS)} codebooks)")


if __name__ == "__main__":
    main()
