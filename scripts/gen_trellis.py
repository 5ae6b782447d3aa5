"""Regenerate turboquant/trellis_tables.py (TCQ tap mask + union codebooks).

    python scripts/gen_trellis.py               # search taps, train, write (~3-5 min on 2 cores)
    python scripts/gen_trellis.py --taps 0xB5   # skip the tap search

Codebooks are trained at unit variance on i.i.d. N(0, 1) sequences of length
128 (one Viterbi run per sequence, zero start state, as the codec encodes a
head vector) and scaled by 1/sqrt(dim) at run time.  Generalized Lloyd:
Viterbi-encode the training set, move every level to the mean of the samples
it reconstructs, repeat until the MSE stops improving (relative change
< 1e-4); the start is the 2^(k+1)-level Gaussian Lloyd-Max quantizer.
The levels are kept symmetric (C[n-1-j] = -C[j]; each mirrored pair moves to
the least-squares point of both cells): the source is symmetric and so is
the trellis (flipping every branch bit flips the parity, the tap mask has an
odd weight), so the constraint costs next to nothing, and it halves the
decoder's lookup (a 2^k-leaf tree over |C| plus a sign).

Tap mask: among the masks with the top state bit (and bit 0) set, the one
with the lowest MSE at k=2 after a short training on a smaller set.
Everything is seeded, so a rerun reproduces the tables (up to float
summation order in MLX).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from turboquant.codebooks import lloyd_max  # noqa: E402
from turboquant.trellis import parity_bits, viterbi  # noqa: E402

NU = 8
BITS = (1, 2, 3, 4)
LENGTH = 128
OUT = ROOT / "turboquant" / "trellis_tables.py"
# Gaussian Lloyd-Max per-sample MSE (the scalar codec's limit), for the printout
LLOYD_MAX = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def gaussian_lloyd_max(levels_log2: int) -> np.ndarray:
    big = 1 << 16  # coordinate density of a unit vector in R^65536 ~ N(0, 1/65536)
    return np.asarray(lloyd_max(levels_log2, big).centroids) * np.sqrt(big)


def encode(X: mx.array, C: np.ndarray, taps: int, nu: int, off=None) -> np.ndarray:
    """Union-codebook codes (2 idx + p) of the rows of X, int64 [N, LENGTH]."""
    idx = viterbi(X, C, taps, nu, off)
    code = (idx << 1) | parity_bits(idx & 1, taps)
    return np.array(code).astype(np.int64)


def train(X: np.ndarray, bits: int, taps: int, nu: int, max_iter: int, tol: float = 1e-4):
    """Generalized Lloyd; returns (levels, start offsets [nu], mse per sample, iterations).

    The reconstruction is ``C[code] - off[i]`` with ``off`` nonzero only for
    the first ``nu`` positions: the zero start state gives those positions
    lopsided supersets (position 0 only sees superset 0), whose error has a
    nonzero mean.  That mean is the same for every vector, so it does not
    average out over the tokens of an attention sum (it cost 2-bit Gaussian
    attention ~20%); ``off`` removes it and is re-fitted with the levels.
    """
    C = gaussian_lloyd_max(bits + 1)
    off = np.zeros(X.shape[1])
    Xm = mx.array(X)
    prev = np.inf
    mse = np.inf
    it = 0
    for it in range(1, max_iter + 1):
        code2 = encode(Xm, C, taps, nu, off)
        code = code2.ravel()
        Xo = (X + off).astype(np.float64)  # the levels quantize x + off
        flat = Xo.ravel()
        mse = float(np.mean((flat - C[code]) ** 2))
        cnt = np.bincount(code, minlength=len(C))
        s = np.bincount(code, weights=flat, minlength=len(C))
        # Symmetric Lloyd step: C[n-1-j] = -C[j] (the decoder looks up |C| in a
        # half-size tree and applies the sign), so each pair of mirrored levels
        # moves to the least-squares point of both cells together.
        pair_cnt = cnt + cnt[::-1]
        new = np.where(pair_cnt > 0, (s - s[::-1]) / np.maximum(pair_cnt, 1), C)
        off = np.zeros(X.shape[1])
        off[:nu] = (new[code2[:, :nu]] - X[:, :nu]).mean(axis=0)
        # The encoder needs each subset ascending (nearest level by midpoints).
        if any(np.any(np.diff(new[q::4]) <= 0) for q in range(4)):
            raise SystemExit(f"gen_trellis: a subset stopped being sorted at k={bits} (taps {taps:#x})")
        C = new
        if prev - mse < tol * mse:
            break
        prev = mse
    # the MSE of the final levels
    code = encode(Xm, C, taps, nu, off).ravel()
    mse = float(np.mean(((X + off).ravel() - C[code]) ** 2))
    return C, off[:nu], mse, it


def search_taps(nu: int, n: int, iters: int) -> int:
    X = np.random.default_rng(1).standard_normal((n, LENGTH)).astype(np.float32)
    best = None
    top = 1 << (nu - 1)
    for taps in range(top | 1, 1 << nu, 2):
        if bin(taps).count("1") % 2 == 0:
            continue  # the symmetric codebooks need an odd tap weight (see above)
        _, _, mse, _ = train(X, 2, taps, nu, iters, tol=0.0)
        if best is None or mse < best[1]:
            best = (taps, mse)
        print(f"  taps {taps:#06x}: k=2 mse {mse:.5f}  (best {best[0]:#06x} {best[1]:.5f})", flush=True)
    return best[0]


def render(taps: int, nu: int, books: dict[int, np.ndarray], offs: dict[int, np.ndarray],
           mses: dict[int, float]) -> str:
    lines = [
        '"""TCQ tables: GENERATED by scripts/gen_trellis.py -- do not edit.',
        "",
        "TAPS: parity tap mask over the last STATES_LOG2 branch bits (bit t = b_{i-1-t}).",
        "CODEBOOKS[k]: 2^(k+1) union-codebook levels (each subset ascending) at UNIT variance (the",
        "codec scales them by 1/sqrt(dim)); level j is in subset j mod 4; symmetric:",
        "CODEBOOKS[k][n-1-j] == -CODEBOOKS[k][j] (the decoder relies on it).",
        "START_OFFSETS[k]: subtracted from the reconstruction at positions 0..STATES_LOG2-1",
        "(unit variance): the mean error there, which the zero start state makes nonzero.",
        "MSE[k]: training-set MSE per sample (unit-variance Gaussian, length-128 sequences).",
        '"""',
        "",
        f"STATES_LOG2 = {nu}",
        f"TAPS = {taps:#x}",
        "",
        "CODEBOOKS: dict[int, tuple[float, ...]] = {",
    ]
    for k, C in books.items():
        lines.append(f"    {k}: ({', '.join(repr(float(v)) for v in C)},),")
    lines.append("}")
    lines.append("")
    lines.append("START_OFFSETS: dict[int, tuple[float, ...]] = {")
    for k, o in offs.items():
        lines.append(f"    {k}: ({', '.join(repr(float(v)) for v in o)},),")
    lines.append("}")
    lines.append("")
    lines.append("MSE: dict[int, float] = {")
    for k, m in mses.items():
        lines.append(f"    {k}: {m!r},")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--taps", type=lambda s: int(s, 0), default=None, help="skip the tap search")
    ap.add_argument("--nu", type=int, default=NU)
    ap.add_argument("--n", type=int, default=4096, help="training sequences of length 128")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--search-n", type=int, default=512)
    ap.add_argument("--search-iters", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    t0 = time.time()
    taps = args.taps
    if taps is None:
        print(f"tap search (nu={args.nu}, k=2, {args.search_n} sequences, {args.search_iters} Lloyd steps)")
        taps = search_taps(args.nu, args.search_n, args.search_iters)
    print(f"taps {taps:#x}  [{time.time() - t0:.0f}s]")
    X = np.random.default_rng(0).standard_normal((args.n, LENGTH)).astype(np.float32)
    books, offs, mses = {}, {}, {}
    for k in BITS:
        C, off, mse, it = train(X, k, taps, args.nu, args.iters)
        books[k], offs[k], mses[k] = C, off, mse
        print(f"k={k}: start offsets {np.round(off, 4).tolist()}")
        if np.any(np.diff(C) <= 0):
            print(f"k={k}: union codebook not sorted (each subset is): {np.round(C, 4).tolist()}")
        print(f"k={k}: mse {mse:.5f} = {mse / LLOYD_MAX[k]:.3f}x Lloyd-Max ({it} iterations)"
              f"  [{time.time() - t0:.0f}s]", flush=True)
    args.out.write_text(render(taps, args.nu, books, offs, mses))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
