"""Many rows over one document: a read-only document cache plus small per-row tails.

All tasks of a document decode as one batch.  The document's per-layer cache
(TurboQuant, fp16 or affine) is filled once by prefill and never written
again; each batch row (one task) appends its prompt suffix and generated
tokens to a tail of its own (:class:`SharedPrefixCache`).  Memory is one
document cache plus ``rows x (suffix + generated)`` exact tokens.

Attention of row ``b`` is a softmax over ``[document; tail_b]``, computed as
partial softmax states (log-sum-exp, normalised output) merged exactly:

* the document is read ONCE for all rows: the rows x GQA group (x query
  positions) of a kv head become the query rows of that kv head,
  ``q [1, H_kv, B*G*L, D]``.  For TurboQuant that is the packed history
  (the GPU decode kernel with ``B*G*L`` rows, else the reference blockwise
  path) plus the document's exact window; for fp16/affine the whole
  document, densely (affine through ``mx.quantized_matmul`` on the packed
  document, padded to a granule on CUDA: see ``turboquant.affine``);
* the tail per row, causal over the row's own tokens, left padding masked
  (rows are left-padded to the longest suffix so one forward pass serves
  every row; a pad column is never seen, a pad query row's output is unused).

Tail tokens of a row are exactly what the same task run alone keeps exact:
the engine holds a TurboQuant document's window during a task (no flush), so
row ``b`` computes the same attention as the task alone, up to float
summation order.  For an affine document the tail stores each token's
quantize->dequantize round trip, which is what ``QuantizedKVCache`` would
attend to.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from .affine import dequantized, dequantizes
from .masks import NEG

DENSE_SCORES_BYTES = 256 << 20  # float32 scores of one block of a dense document
FLOAT32_TOKENS = 8192  # dense parts up to this long are multiplied in float32


def _merge(a: tuple[mx.array, mx.array], b: tuple[mx.array, mx.array]) -> tuple[mx.array, mx.array]:
    """Merge two partial softmax states ``(lse [..., 1], out [..., Dv])``."""
    (la, oa), (lb, ob) = a, b
    m = mx.maximum(la, lb)
    wa, wb = mx.exp(la - m), mx.exp(lb - m)
    tot = wa + wb
    return m + mx.log(tot), (wa * oa + wb * ob) / tot


def _partial(scores: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    """Softmax state of float32 ``scores [..., T]`` against ``values [..., T, Dv]``."""
    m = scores.max(axis=-1, keepdims=True)
    m = mx.maximum(m, NEG)  # a fully masked row: weights 0, no NaN
    p = mx.exp(scores - m)
    s = p.sum(axis=-1, keepdims=True)
    out = (p @ values) / mx.maximum(s, 1e-30)
    return m + mx.log(mx.maximum(s, 1e-30)), out


def _dense_partial(q: mx.array, keys: mx.array, values: mx.array, n: int) -> tuple[mx.array, mx.array]:
    """Partial state of ``q [1, H, M, D]`` (float32, scaled) over dense
    ``keys/values [1, H, >=n, D]``'s first ``n`` tokens.

    Up to ``FLOAT32_TOKENS`` tokens (a TurboQuant window, a row's tail, a
    short document) the products run in float32.  A long half-precision
    document (the fp16 baseline) multiplies in its own dtype with float32
    accumulation and float32 softmax statistics: casting it to float32 would
    read and write 5x its bytes per step, a cost no fused attention pays.
    Blocks keep the float32 scores under ``DENSE_SCORES_BYTES``.
    """
    _, H, M, D = q.shape
    dt = mx.float32 if n <= FLOAT32_TOKENS else keys.dtype
    qd = q.astype(dt)
    block = max(256, DENSE_SCORES_BYTES // max(1, 4 * H * M))
    state = None
    for a in range(0, n, block):
        e = min(n, a + block)
        k, v = keys[:, :, a:e].astype(dt), values[:, :, a:e].astype(dt)
        scores = (qd @ k.swapaxes(-1, -2)).astype(mx.float32)
        m = scores.max(axis=-1, keepdims=True)
        p = mx.exp(scores - m)
        s = p.sum(axis=-1, keepdims=True)
        out = (p.astype(dt) @ v).astype(mx.float32) / s
        part = (m + mx.log(s), out)
        state = part if state is None else _merge(state, part)
    return state


def _affine_partial(q: mx.array, doc, n: int) -> tuple[mx.array, mx.array]:
    """Partial state over an affine ``QuantizedKVCache`` document's first
    ``n`` tokens, straight from its packed triples (off CUDA: there
    :func:`document_partial` dequantizes, see ``affine``)."""
    from mlx.utils import tree_map

    gs, bits = doc.group_size, doc.bits
    keys = tree_map(lambda x: x[..., :n, :], doc.keys)
    values = tree_map(lambda x: x[..., :n, :], doc.values)
    dtype = keys[1].dtype
    scores = mx.quantized_matmul(q.astype(dtype), *keys, transpose=True, group_size=gs, bits=bits)
    scores = scores.astype(mx.float32)
    m = scores.max(axis=-1, keepdims=True)
    p = mx.exp(scores - m)
    s = p.sum(axis=-1, keepdims=True)
    out = mx.quantized_matmul(p.astype(dtype), *values, transpose=False, group_size=gs, bits=bits)
    return m + mx.log(s), out.astype(mx.float32) / s


def _document_route(q: mx.array, doc):
    """The kernel decision (``attention.route.choose``) for reading the
    packed document with ``q [1, H_kv, R, D]``: R rows per kv head, no mask.
    Only the packed part's softmax state is wanted here, so the fused step
    (which also takes the window) becomes its kernel, tc8."""
    from .attention import device
    from .attention.route import Route, choose, describe

    wk = doc.window_keys if doc.window_keys is not None else q[:, :, :0]
    wv = doc.window_values if doc.window_values is not None else wk
    route = choose(describe(q, wk, wv, doc, None, None, None, device.on_gpu()), device.backend(), device.mode())
    return Route.TC8 if route is Route.FUSED_STEP else route


def _turboquant_packed_partial(q: mx.array, doc) -> tuple[mx.array, mx.array]:
    """Partial state of ``q [1, H_kv, R, D]`` over a TurboQuant document's
    packed history, centring terms included, in the original domain: the
    split-K kernel the route names (tc8 up to 8 rows per kv head, the
    16-row-tile tc kernel beyond, SIMT for a few rows on other GPUs), else
    the blockwise reference path."""
    from .attention import launchers
    from .attention.compose import block_mean, key_scale, value_rotation
    from .attention.pair_tables import centroids
    from .attention.reference import _packed_part
    from .attention.route import Route

    q_rot = doc.rotation.forward(q * key_scale(doc))
    vrot = value_rotation(doc)
    route = _document_route(q, doc)
    if route in (Route.TC8, Route.TC, Route.SIMT):
        out_p, lse_p = launchers.decode(
            q_rot, doc.keys_packed, doc.keys_norms, doc.values_packed, doc.values_norms,
            centroids(doc.key_codec), centroids(doc.value_codec),
            doc.packed_len, doc.key_codec.bits, doc.value_codec.bits, route,
            key_bias=launchers.key_bias(doc, q, doc.packed_len) if block_mean(doc) else None,
        )
        lse, out_rot = lse_p[..., None], out_p
    else:  # reference (no GPU, a trellis codec, or rows the SIMT kernel does not take)
        R = q.shape[2]
        m, s, acc = _packed_part(q_rot, doc, None, R, 1, q)
        lse, out_rot = m + mx.log(s), acc / s
    if doc.key_mean is not None:
        lse = lse + q @ doc.key_mean.astype(mx.float32).swapaxes(-1, -2)
    out = vrot.inverse(out_rot)
    if doc.value_mean is not None:
        out = out + doc.value_mean.astype(mx.float32)
    return lse, out


def document_partial(q: mx.array, doc) -> Optional[tuple[mx.array, mx.array]]:
    """Partial softmax state of ``q [1, H_kv, R, D]`` (float32, scaled) over
    the whole document cache ``doc``, or None for an empty document."""
    from .cache import TurboQuantKVCache

    if isinstance(doc, TurboQuantKVCache):
        state = _turboquant_packed_partial(q, doc) if doc.packed_len > 0 else None
        w = 0 if doc.window_keys is None else doc.window_keys.shape[2]
        if w:
            part = _dense_partial(q, doc.window_keys, doc.window_values, w)
            state = part if state is None else _merge(state, part)
        return state
    n = int(doc.offset)
    if n == 0:
        return None
    if dequantizes(doc):  # CUDA's quantized_matmul fails on these products (see affine)
        keys, values = (dequantized(doc, tuple(x[..., :n, :] for x in t)) for t in (doc.keys, doc.values))
        return _dense_partial(q, keys, values, n)
    if hasattr(doc, "bits"):  # mlx's affine QuantizedKVCache
        return _affine_partial(q, doc, n)
    return _dense_partial(q, doc.keys, doc.values, n)


def shareable(model, caches: Sequence) -> bool:
    """Whether every layer's cache is one :func:`document_partial` reads
    (TurboQuant, mlx-lm ``KVCache``, affine ``QuantizedKVCache``) and the
    model's attention goes through the base function the hook wraps."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from .affine import PaddedQuantizedKVCache
    from .cache import TurboQuantKVCache
    from .prompt_cache import _direct_sdpa_modules

    kinds = (TurboQuantKVCache, KVCache, QuantizedKVCache, PaddedQuantizedKVCache)
    if not caches or any(type(c) not in kinds for c in caches):
        return False
    return not _direct_sdpa_modules(model)


class SharedPrefixCache(_BaseCache):
    """One layer's cache for ``B`` rows that share a read-only document cache.

    ``document`` is the layer's prefilled cache (any of TurboQuant, mlx-lm
    ``KVCache``, ``QuantizedKVCache``), never written here.  ``pads[b]`` is
    row ``b``'s left padding: the first tail call carries every row's suffix
    right-aligned, so all rows end at the same column and one forward pass
    per step serves them all.  ``offset`` is a per-row int32 array (RoPE
    positions continue each row's own sequence after the document); models
    that use the offset only for RoPE (llama, qwen2/3, mistral, ... in
    mlx-lm) accept it, as they do for mlx-lm's own batch cache.
    """

    step = 64  # tail capacity granularity in tokens

    def __init__(self, document, pads: Sequence[int]):
        self.document = document
        self.doc_len = int(document.offset)
        self.pads = mx.array(list(pads), dtype=mx.int32)
        self.length = 0  # tail columns written (pads included)
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self._offset: Optional[mx.array] = None
        quantized = hasattr(document, "bits")
        self._round_trip = (document.group_size, document.bits) if quantized else None

    @property
    def rows(self) -> int:
        return self.pads.shape[0]

    @property
    def offset(self) -> mx.array:
        if self._offset is None:
            self._offset = self.doc_len - self.pads + self.length
        return self._offset

    def _store(self, x: mx.array) -> mx.array:
        if self._round_trip is None:
            return x
        gs, bits = self._round_trip
        return mx.dequantize(*mx.quantize(x, group_size=gs, bits=bits), group_size=gs, bits=bits).astype(x.dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys/values [B, H, L, D]`` to the rows' tails; return the tails."""
        B, H, L, D = keys.shape
        Dv = values.shape[-1]
        need = self.length + L
        cap = 0 if self.keys is None else self.keys.shape[2]
        if need > cap:
            new_cap = -(-need // self.step) * self.step
            k_new = mx.zeros((B, H, new_cap, D), keys.dtype)
            v_new = mx.zeros((B, H, new_cap, Dv), values.dtype)
            if self.keys is not None and self.length:
                k_new[:, :, : self.length] = self.keys[:, :, : self.length]
                v_new[:, :, : self.length] = self.values[:, :, : self.length]
            self.keys, self.values = k_new, v_new
        self.keys[:, :, self.length : need] = self._store(keys)
        self.values[:, :, self.length : need] = self._store(values)
        self.length = need
        self._offset = None
        return self.keys[:, :, :need], self.values[:, :, :need]

    def keep(self, rows: Sequence[int]) -> None:
        """Drop every row not in ``rows`` (rows that finished decoding)."""
        idx = mx.array(list(rows), dtype=mx.int32)
        self.pads = self.pads[idx]
        if self.keys is not None:
            self.keys, self.values = self.keys[idx], self.values[idx]
        self._offset = None

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """None: :func:`shared_prefix_attention` builds the tail's mask from
        the rows' padding itself (the document part needs none)."""
        if window_size is not None:
            raise ValueError("SharedPrefixCache: sliding-window layers cannot share a document cache")
        return None

    def tail_mask(self, L: int) -> mx.array:
        """bool [B, 1, 1, L, T]: query ``l`` of row ``b`` (tail column
        ``T - L + l``) sees tail columns ``pads[b] <= c <= T - L + l``."""
        T = self.length
        cols = mx.arange(T)[None, None, :]
        qpos = (T - L + mx.arange(L))[None, :, None]
        ok = (cols >= self.pads[:, None, None]) & (cols <= qpos)
        return ok[:, None, None]

    @property
    def nbytes(self) -> int:
        """Bytes of the tails (the document cache counts separately)."""
        return sum(a.nbytes for a in (self.keys, self.values) if a is not None)

    def size(self) -> int:
        return self.doc_len + self.length

    def empty(self) -> bool:
        return False

    def is_trimmable(self) -> bool:
        return False


def shared_prefix_attention(queries: mx.array, tail_keys: mx.array, tail_values: mx.array,
                            cache: SharedPrefixCache, scale: float) -> mx.array:
    """Attention of ``queries [B, H_q, L, D]`` over ``[document; tail_b]`` per row.

    The document part runs once for all rows (rows x group x positions as
    query rows of each kv head); the tail part per row with its mask.
    Returns ``[B, H_q, L, Dv]`` in the queries' dtype.
    """
    B, H_q, L, D = queries.shape
    H_kv = tail_keys.shape[1]
    if H_q % H_kv:
        raise ValueError(f"shared_prefix_attention: {H_q} query heads vs {H_kv} kv heads")
    G = H_q // H_kv
    q5 = (queries.astype(mx.float32) * scale).reshape(B, H_kv, G, L, D)

    # tail: per row, [B, H_kv, G*L, T]
    kT = tail_keys.astype(mx.float32).swapaxes(-1, -2)[:, :, None]  # [B, H, 1, D, T]
    scores = q5 @ kT  # [B, H, G, L, T]
    scores = mx.where(cache.tail_mask(L), scores, NEG)
    lse_t, out_t = _partial(scores, tail_values.astype(mx.float32)[:, :, None])
    state = (lse_t.reshape(B, H_kv, G * L, 1), out_t.reshape(B, H_kv, G * L, -1))

    # document: once for all rows
    q_doc = q5.transpose(1, 0, 2, 3, 4).reshape(1, H_kv, B * G * L, D)
    doc = document_partial(q_doc, cache.document)
    if doc is not None:
        lse_d, out_d = (x.reshape(H_kv, B, G * L, -1).transpose(1, 0, 2, 3) for x in doc)
        state = _merge((lse_d, out_d), state)
    out = state[1].reshape(B, H_q, L, -1)
    return out.astype(queries.dtype)
