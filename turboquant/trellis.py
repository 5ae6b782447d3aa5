"""Trellis-coded quantization (TCQ) of the rotated unit direction.

Why: with the TurboQuant layout (b-bit index per rotated coordinate + one
float16 scale per vector) a scalar Lloyd-Max quantizer is the best one can
do coordinate by coordinate, and on Gaussian-like data our cache then only
matches mlx-vlm's (same codebook, rotation and bytes).  A trellis-coded
quantizer spends the SAME b bits per coordinate but lets each coordinate's
codebook depend on the previous choices, which buys the ~1-1.4 dB granular
gain a scalar quantizer cannot reach (Marcellin & Fischer 1990): MSE x~0.75
on memoryless Gaussian sources at 256 states.

Layout, chosen so that DECODING is parallel and cheap (no sequential state
machine, no gathers):

* the stored index ``idx_i`` (b bits, the same packing, words and float16
  scale as the scalar codec, so bytes are identical) is ``(w_i << 1) | b_i``;
  ``b_i = idx_i & 1`` is the *branch bit*;
* the trellis state before coordinate ``i`` is the last ``nu`` branch bits
  ``s_i = (b_{i-1}, ..., b_{i-nu})`` (bit ``j-1`` of ``s_i`` is ``b_{i-j}``;
  ``b_j = 0`` for ``j < 0``: zero start, no tail, no rate loss) -- a
  "bitshift" trellis, ``s_{i+1} = ((s_i << 1) | b_i) mod 2^nu``;
* the parity ``p_i = popcount(h & s_i) mod 2`` for a fixed tap mask ``h``,
  i.e. the XOR of a few shifted copies of the branch-bit sequence;
* the unit-scale reconstruction is ``C[2 * idx_i + p_i]`` with ``C`` a
  union codebook of ``2^(b+1)`` levels (level ``j`` is in subset ``j mod 4``;
  the parity picks the superset ``{p, p+2}``, the branch bit the subset,
  ``w`` the level inside it).  ``C`` is sorted for b = 2..4; each subset is
  always ascending, which is all the encoder needs (training left b = 1 with
  two near-zero levels out of order).  ``C`` is symmetric, ``C[n-1-j] = -C[j]``
  (trained that way: the source is symmetric, and flipping every branch
  bit flips the parity because the tap mask has odd weight), which lets
  the CPU decoder look up ``|C|`` in a 2^b-leaf tree plus a sign.

* minus a fixed per-position offset at the first ``nu`` positions
  (``START_OFFSETS``): the zero start state restricts those positions to
  lopsided supersets (position 0 only ever sees superset 0), so their error
  had a nonzero mean, the SAME for every vector.  Random errors shrink in an
  attention sum over T tokens, a common bias does not: it cost ~20% of the
  2-bit attention error on Gaussian K/V at T=4096 before the offsets.  The
  encoder quantizes ``u + offset`` so the search stays exact.

Why this trellis: a feed-forward shift register makes the state a pure
function of the stored bits, so the decoder never runs the trellis; the
zero start state costs no rate (no tail bits); the union codebook with four
subsets is Ungerboeck's set partitioning, which is what gives TCQ its gain.
Measured at d=128 (unit vectors, lsq scale, ``python -m benchmarks.codec``):
MSE 0.72x / 0.68x / 0.67x the scalar Lloyd-Max codec at b = 2 / 3 / 4.

A decoder therefore XORs shifted copies of the packed words (the parities)
and does a select-tree lookup: a few word-level ops more than the scalar
codec, independent of ``nu`` (only the encoder's Viterbi search grows with
2^nu).  The attention's decoder is ``turboquant.decode``.

Encoder: Viterbi over the 2^nu states.  Per coordinate the best level and
its distortion in each of the four subsets are found once (they do not
depend on the state); each trellis step is then adds/mins over [N, 2^nu].
The backpointers ([d, N, 2^nu] bools) bound the batch size.  The scale is
then computed exactly as the scalar codec does (``codec.stored_scale``).

The union codebooks are trained by generalized Lloyd (Viterbi-encode, move
each level to the mean of its samples) on unit-variance Gaussian sequences of
length 128 and scaled by ``1/sqrt(dim)`` here (a coordinate of a random unit
vector in R^dim is ~N(0, 1/dim); the per-vector least-squares scale absorbs
the small mismatch); ``scripts/gen_trellis.py`` regenerates
``trellis_tables.py`` and picked the tap mask (0xe5: the lowest MSE at b=2
among the 64 odd masks with the top bit set; most masks were within 1%).

Costs: quantizing is a Viterbi search (NumPy on the host: d dependent steps
of small array ops), ~0.25 ms per vector of d=128 in bulk on this 2-core CPU
and ~3 ms for a decode step's 9 vectors of d=64; decoding is ~2x the scalar
codec's on CPU (``turboquant.decode``: parity and sign-magnitude codes on the
packed words, one 2^b-leaf select tree, a sign).  The GPU kernels do not
implement it.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from .codec import PackedCodec, QuantizedVectors, stored_scale
from .packing import pack
from .rotation import HadamardRotation

BATCH_BYTES = 192 << 20  # most backpointer bytes alive per Viterbi batch


def _tables():
    from .trellis_tables import CODEBOOKS, TAPS

    return CODEBOOKS, TAPS


def parity_table(taps: int, nu: int) -> np.ndarray:
    """p(s) = popcount(taps & s) mod 2 for every state s < 2^nu (uint8)."""
    s = np.arange(1 << nu, dtype=np.int64) & taps
    p = np.zeros_like(s)
    while s.any():
        p ^= s & 1
        s >>= 1
    return p.astype(np.uint8)


@lru_cache(maxsize=None)
def _subset_fn(n_levels: int):
    """(u [..., d], C [n_levels]) -> (dist [..., d, 2(p), 2(b)], w [..., d, 2, 2]).

    Subset ``q = 2b + p`` holds levels ``C[4w + q]`` (ascending in ``w``);
    the nearest one is found by a chain of compares against the midpoints,
    its value by a select chain: no gathers.  The levels are an input, not
    constants, so training new levels does not compile new kernels.
    """
    n_w = n_levels // 4

    def f(u, C):
        ds, ws = [], []
        for p in (0, 1):
            dp, wp = [], []
            for b in (0, 1):
                q = 2 * b + p
                lv = [C[4 * j + q] for j in range(n_w)]
                w = mx.zeros(u.shape, mx.uint32)
                val = mx.broadcast_to(lv[0], u.shape)
                for j in range(1, n_w):
                    above = u > 0.5 * (lv[j - 1] + lv[j])
                    w = w + above.astype(mx.uint32)
                    val = mx.where(above, lv[j], val)
                e = u - val
                dp.append(e * e)
                wp.append(w)
            ds.append(mx.stack(dp, axis=-1))
            ws.append(mx.stack(wp, axis=-1))
        return mx.stack(ds, axis=-2), mx.stack(ws, axis=-2)

    return mx.compile(f)


@lru_cache(maxsize=None)
def _x0_parity(taps: int, nu: int) -> np.ndarray:
    """p(r) for the x = 0 half of the states (bool [S/2]).

    State s' = 2r + b has predecessors x*S/2 + r (x = 0, 1).  The tap mask
    includes the oldest bit, so p(x*S/2 + r) = x XOR p(r): each half's branch
    cost is one select between two per-row scalars over this constant mask.
    """
    H = (1 << nu) // 2
    par = parity_table(taps, nu)
    if not np.array_equal(par[H:], par[:H] ^ 1):
        raise ValueError(f"viterbi: tap mask {taps:#x} must include the oldest state bit")
    return par[:H].astype(bool)


_BIT = None


def _bit_positions() -> mx.array:
    global _BIT
    if _BIT is None:
        _BIT = mx.arange(32, dtype=mx.uint32)
    return _BIT


def parity_bits(branch: mx.array, taps: int) -> mx.array:
    """p_i = XOR over taps t of b_{i-1-t} (zero before the start); uint32 [..., d].

    The branch bits are packed 32 to a word first, so the shifts run on
    d/32 words per vector instead of d values (4x faster than shifting the
    unpacked bits, which is most of the TCQ decode overhead).
    """
    d = branch.shape[-1]
    lead = branch.shape[:-1]
    nw = -(-d // 32)
    bits = _bit_positions()
    b = branch.astype(mx.uint32) & 1
    if nw * 32 != d:
        b = mx.pad(b, [(0, 0)] * len(lead) + [(0, nw * 32 - d)])
    bw = (b.reshape(*lead, nw, 32) << bits).sum(axis=-1).astype(mx.uint32)  # distinct bits: sum = OR
    prev = mx.concatenate([mx.zeros((*lead, 1), mx.uint32), bw[..., :-1]], axis=-1)
    acc = mx.zeros(bw.shape, mx.uint32)
    t = 0
    while taps >> t:
        if (taps >> t) & 1:
            sh = t + 1  # <= 31: nu <= 31
            acc = acc ^ (bw << sh) ^ (prev >> (32 - sh))
        t += 1
    p = (acc[..., None] >> bits) & 1
    return p.reshape(*lead, nw * 32)[..., :d]


def _search(dist: np.ndarray, taps: int, nu: int) -> np.ndarray:
    """The add-compare-select recursion and the traceback: branch bits
    (uint32 [N, d]) of the least-cost path from the zero state, given the
    per-coordinate costs ``dist`` [N, d, 2(p), 2(b)].

    In NumPy: the recursion is d dependent steps of a few small array ops,
    and at a decode step's size MLX's per-op dispatch costs several times
    the work (9 vectors of d=64: 7-9 ms with MLX ops, 3 ms here, 2-core
    CPU); in bulk the two are level (4,096 vectors of d=128: ~1 s each).
    """
    N, d = dist.shape[:2]
    S = 1 << nu
    H = S // 2
    q = _x0_parity(taps, nu)
    J = np.full((N, S), 1e30, np.float32)
    J[:, 0] = 0.0  # zero start state
    nxt = np.empty_like(J)
    back = np.empty((d, N, S), bool)  # x of the best predecessor of each state
    for i in range(d):
        J0, J1 = J[:, :H], J[:, H:]
        for b in (0, 1):
            d0, d1 = dist[:, i, 0, b : b + 1], dist[:, i, 1, b : b + 1]  # [N, 1]
            c0 = J0 + np.where(q, d1, d0)  # x = 0: parity p(r)
            c1 = J1 + np.where(q, d0, d1)  # x = 1: parity 1 - p(r)
            np.minimum(c0, c1, out=nxt[:, b::2])  # s' = 2r + b
            np.less(c1, c0, out=back[i][:, b::2])
        J, nxt = nxt, J
    s = J.argmin(axis=-1).astype(np.uint32)
    rows = np.arange(N)
    branch = np.empty((N, d), np.uint32)
    for i in range(d - 1, -1, -1):
        branch[:, i] = s & 1
        s = (s >> 1) | (back[i, rows, s].astype(np.uint32) << (nu - 1))
    return branch


def viterbi(u: mx.array, levels, taps: int, nu: int, offsets=None) -> mx.array:
    """Best index sequence (uint32 [N, d]) of rows ``u`` [N, d] for the union
    codebook ``levels`` (2^(k+1), ascending) under the trellis (taps, nu).

    Minimises sum_i (u_i - C[2 idx_i + p_i] + offsets_i)^2 exactly (tests
    check it by brute force).  Batches rows so the backpointers stay < BATCH_BYTES.
    """
    if offsets is not None:
        u = u + mx.array(np.asarray(offsets, dtype=np.float32))
    N, d = u.shape
    S = 1 << nu
    batch = max(1, BATCH_BYTES // (d * S))
    if N > batch:
        return mx.concatenate(
            [viterbi(u[a : a + batch], levels, taps, nu) for a in range(0, N, batch)], axis=0
        )
    C = mx.array(np.asarray(levels, dtype=np.float32))
    dist, wsub = _subset_fn(C.size)(u.astype(mx.float32), C)  # [N, d, 2, 2]
    b = mx.array(_search(np.array(dist), taps, nu))  # [N, d]
    p = parity_bits(b, taps)
    w = mx.where(
        p.astype(mx.bool_),
        mx.where(b.astype(mx.bool_), wsub[..., 1, 1], wsub[..., 1, 0]),
        mx.where(b.astype(mx.bool_), wsub[..., 0, 1], wsub[..., 0, 0]),
    )
    return (w << 1) | b


def reconstruct(idx: mx.array, levels, taps: int, offsets=None) -> mx.array:
    """Unit-scale reconstruction C[2 idx + p] - offsets of index rows [..., d] (float32)."""
    # A gather: this is the encoder's side (one call per quantize, next to a
    # Viterbi search); attention decodes through ``turboquant.decode``.
    j = (idx.astype(mx.uint32) << 1) | parity_bits(idx & 1, taps)
    c = mx.take(mx.array(np.asarray(levels, np.float32)), j)
    if offsets is not None:
        c = c - mx.array(np.asarray(offsets, dtype=np.float32))
    return c


def start_offsets(bits: int, dim: int) -> np.ndarray:
    """Per-position reconstruction offsets [dim] (nonzero for the first STATES_LOG2)."""
    from .trellis_tables import START_OFFSETS

    off = np.zeros(dim, np.float64)
    o = np.asarray(START_OFFSETS[bits], np.float64)[:dim]
    off[: len(o)] = o
    return off / np.sqrt(dim)


def union_levels(bits: int, dim: int) -> np.ndarray:
    """The union codebook (2^(bits+1) levels) for coordinates of unit vectors in R^dim."""
    cbs, _ = _tables()
    if bits not in cbs:
        raise ValueError(f"TrellisCodec: bits must be one of {sorted(cbs)}, got {bits}")
    return np.asarray(cbs[bits], dtype=np.float64) / np.sqrt(dim)


class TrellisCodec(PackedCodec):
    """TCQ codec with the interface and byte layout of ``TurboQuantCodec``.

    ``bits`` per coordinate (1..4) packed exactly as the scalar codec packs
    its indices, plus the same float16 scale; only the meaning of the
    indices differs (see the module docstring).  The GPU kernels only know
    scalar codes, so ``attention.route.choose`` routes a cache holding this codec
    to the reference path (``quantizer == "tcq"``).
    """

    quantizer = "tcq"

    def __init__(
        self, dim: int, bits: int, rotation: HadamardRotation | None = None,
        states_log2: int | None = None, unbiased: bool = False,
    ):
        from .trellis_tables import STATES_LOG2, TAPS

        self._init_layout(dim, bits, rotation, unbiased)
        if states_log2 is None:
            states_log2 = STATES_LOG2
        if states_log2 != STATES_LOG2:
            raise ValueError(
                f"TrellisCodec: states_log2={states_log2}; the codebooks in trellis_tables.py "
                f"were trained for {STATES_LOG2} (rerun scripts/gen_trellis.py --nu {states_log2})"
            )
        self.states_log2, self.taps = states_log2, TAPS
        self.levels = tuple(float(v) for v in union_levels(bits, dim).astype(np.float32))
        self.offsets = tuple(float(v) for v in start_offsets(bits, dim).astype(np.float32))
        self.code_key = ("tcq", bits, dim, self.taps, self.levels, self.offsets)

    def __repr__(self) -> str:
        return (f"TrellisCodec(dim={self.dim}, bits={self.bits}, "
                f"states_log2={self.states_log2}, taps={self.taps:#x}, unbiased={self.unbiased})")

    def quantize_rotated(self, y: mx.array) -> QuantizedVectors:
        """Quantize already-rotated vectors ``y`` [..., dim] (Viterbi search)."""
        lead = y.shape[:-1]
        norm, u = self._unit_direction(y)
        norm, u = norm.reshape(-1), u.reshape(-1, self.dim)
        if u.shape[0] == 0:
            idx = mx.zeros(u.shape, mx.uint32)
        else:
            idx = viterbi(u, self.levels, self.taps, self.states_log2, self.offsets)
        c = reconstruct(idx, self.levels, self.taps, self.offsets)
        dot, c_sq = (u * c).sum(axis=-1), mx.maximum((c * c).sum(axis=-1), 1e-30)
        scale = stored_scale(norm, dot, c_sq, self.unbiased)
        return QuantizedVectors(pack(idx, self.bits).reshape(*lead, self.words), scale.reshape(lead))

