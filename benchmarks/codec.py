"""Benchmark TurboQuant against fp16, mlx-lm's affine cache and mlx-vlm's TurboQuant.

    python -m benchmarks.codec            # full run (contexts 4k, 16k, 32k)
    python -m benchmarks.codec --quick    # < 1 minute on 2 CPU cores
    python -m benchmarks.codec --json     # + one JSON object on the last line

Everything is measured in one process on the same tensors:

* storage: bytes per token per KV head, counted from the arrays each method
  stores per token (per-layer means, window and capacity slack left out);
* MSE of unit vectors vs the Lloyd-Max figure and the 4^-b lower bound;
* inner-product error of keys against decode queries;
* attention-output 1-cos vs float32 attention on float32 K/V, on Gaussian
  data (the peer's setting) and on "outlier" data shaped like real K/V.
  "ours": the shipped method (James-Stein-shrunk per-head mean of the first
  chunk removed, then the codec); "codec only": no centring; "peer":
  ``mlx_vlm.turboquant.TurboQuantKVCache`` on its own reconstruction
  through the same SDPA; "system": our cache + attention path (window
  included), "sys_nowin" with window 0; "swapped": the extra bit of 2.5/3.5
  on keys; "tcq": the trellis-coded quantizer (same bytes);
* decode-attention time per token (1 query, 32 query / 8 KV heads, d=128)
  vs fp16 and fp32 SDPA, medians of interleaved repetitions (the TCQ cache
  reuses the scalar cache's words: ``tcq_cache_like``);
* quantize time of the scalar and the TCQ codec on the same vectors.

The peer is imported here and only here: ``turboquant`` itself never depends
on mlx-vlm's cache.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

import turboquant  # noqa: F401  (fast CPU BLAS before mlx.core is used)
from turboquant.attention import turboquant_attention
from turboquant.cache import make_codecs, shrunk_mean
from turboquant.codebooks import codebook
from turboquant.codec import TurboQuantCodec
from turboquant.policy import ALLOWED_KV_BITS, resolve_bits
from turboquant.rotation import HadamardRotation
from turboquant.trellis import TrellisCodec

D, H_KV, H_Q = 128, 8, 32
SCALE = 1.0 / math.sqrt(D)
FP16_BYTES = 2 * 2 * D  # keys + values, per token per KV head
CENTRE_CHUNK = 512  # tokens the per-head mean is taken from (first prefill chunk)


@dataclass
class Config:
    quality_tokens: int = 4096
    contexts: tuple[int, ...] = (4096, 16384, 32768)
    reps: int = 5
    n_queries: int = 64
    seed: int = 0
    mse_vectors: int = 4096
    timing: bool = True
    affine_max_context: int = 4096
    peer: bool = True
    tcq_system: bool = True  # TCQ through the cache + attention path too
    tcq_codec_only: bool = True
    quantize_vectors: int = 4096
    notes: list[str] = field(default_factory=list)


QUICK = dict(quality_tokens=512, contexts=(1024, 4096), reps=3, n_queries=8, mse_vectors=2048,
             affine_max_context=1024, tcq_system=False, tcq_codec_only=False, quantize_vectors=1024)


# ---------------------------------------------------------------- data
def make_data(kind: str, tokens: int, n_queries: int, seed: int):
    """Queries [1, H_Q, n_q, D], keys and values [1, H_KV, T, D] (float32).

    ``gaussian``: everything N(0, 1), the peer's benchmark setting.
    ``outlier``: per-channel offsets (std 2), 4 key channels scaled 10-20x
    with large offsets, 2 value channels 5x, and queries that also weight the
    outlier channels -- the pattern of real pre-RoPE keys, where attention is
    peaky and a mean offset dominates the norm.
    """
    k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((1, H_Q, n_queries, D), key=k1)
    k = mx.random.normal((1, H_KV, tokens, D), key=k2)
    v = mx.random.normal((1, H_KV, tokens, D), key=k3)
    if kind == "gaussian":
        return q, k, v
    if kind != "outlier":
        raise ValueError(f"make_data: unknown kind {kind!r}")
    rng = np.random.default_rng(seed + 1)
    ks = np.ones((H_KV, D), np.float32)
    ko = rng.normal(0, 2.0, (H_KV, D)).astype(np.float32)
    vs = np.ones((H_KV, D), np.float32)
    vo = rng.normal(0, 1.0, (H_KV, D)).astype(np.float32)
    qs = np.ones((H_Q, D), np.float32)
    for h in range(H_KV):
        hot = rng.choice(D, 4, replace=False)
        ks[h, hot] = rng.uniform(10, 20, 4)
        ko[h, hot] = rng.choice([-1, 1], 4) * rng.uniform(10, 30, 4)
        vs[h, rng.choice(D, 2, replace=False)] = 5.0
        qs[h * (H_Q // H_KV) : (h + 1) * (H_Q // H_KV), hot] = 0.3
    k = k * mx.array(ks)[None, :, None] + mx.array(ko)[None, :, None]
    v = v * mx.array(vs)[None, :, None] + mx.array(vo)[None, :, None]
    q = q * mx.array(qs)[None, :, None] + 0.5 * mx.random.normal((1, H_Q, 1, D), key=k4)
    return q, k, v


def sdpa(q, k, v):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)


def one_minus_cos(out: mx.array, ref: mx.array) -> float:
    out, ref = out.astype(mx.float32), ref.astype(mx.float32)
    cos = (out * ref).sum(-1) / (mx.linalg.norm(out, axis=-1) * mx.linalg.norm(ref, axis=-1))
    return float((1 - cos).mean())


# ---------------------------------------------------------------- methods
def ours_reconstruct(k, v, kb: int, vb: int, centre: bool = True, quantizer: str = "scalar"):
    """Reconstructed K/V of our method (what the packed-cache attention computes with).

    ``centre``: True = the cache's James-Stein-shrunk per-head mean of the
    first CENTRE_CHUNK tokens; False = no centring.  ``quantizer``: "scalar" or "tcq" (trellis).
    """
    rot = HadamardRotation(D, 1234)
    kc, vc = make_codecs(quantizer, kb, vb, rot, rot)  # as the cache pairs them
    out = []
    for x, c in ((k, kc), (v, vc)):
        if centre:
            mu = shrunk_mean(x[:, :, :CENTRE_CHUNK], axis=2)
        else:
            mu = 0.0
        out.append(c.dequantize(*c.quantize(x - mu)) + mu)
    return out


def peer_cache(bits: float, k, v):
    from mlx_vlm.turboquant import TurboQuantKVCache as PeerCache

    cache = PeerCache(bits=bits)
    kp, vp = cache.update_and_fetch(k, v)
    mx.eval(cache.keys, cache.values)
    return cache, kp, vp


def peer_reconstruct(cache):
    """The peer's dequantized K/V (float32), i.e. what its attention computes with."""
    kh, vh = cache.dequantize()
    return kh.astype(mx.float32), vh.astype(mx.float32)


def peer_attention(cache, kp, vp, q):
    """mlx-vlm's own attention entry point, one decode query at a time."""
    from mlx_vlm.models.base import scaled_dot_product_attention as vlm_sdpa

    outs = [vlm_sdpa(q[:, :, i : i + 1], kp, vp, cache, scale=SCALE, mask=None)
            for i in range(q.shape[2])]
    return mx.concatenate(outs, axis=2)


def affine_cache(bits: int, k, v):
    from mlx_lm.models.cache import QuantizedKVCache

    cache = QuantizedKVCache(group_size=64, bits=bits)
    qk, qv = cache.update_and_fetch(k.astype(mx.float16), v.astype(mx.float16))
    mx.eval(qk, qv)
    return cache, qk, qv


def affine_attention(bits: int, qk, qv, q):
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    return quantized_scaled_dot_product_attention(
        q.astype(mx.float16), qk, qv, scale=SCALE, mask=None, group_size=64, bits=bits
    )


def ours_cache(kv_bits: float, k, v, window: int | None = None, quantizer: str = "scalar"):
    """Our TurboQuantKVCache filled like a prefill of T-1 tokens plus one decode step."""
    from turboquant.cache import TurboQuantKVCache

    kw = {} if window is None else {"window": window}
    cache = TurboQuantKVCache(kv_bits, seed=1234, quantizer=quantizer, **kw)
    cache.update_and_fetch(k[:, :, :-1], v[:, :, :-1])
    wk, wv = cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
    mx.eval(wk, wv, cache.keys_packed, cache.values_packed)
    return cache, wk, wv


def tcq_cache_like(cache):
    """A TCQ cache holding ``cache``'s packed words (same layout and bytes).

    For decode TIMING only: the TCQ decode does the same work whatever the
    words are, and running the Viterbi encoder over 32k tokens x 8 heads at
    every width would take minutes per context on this CPU.
    """
    import copy

    from turboquant.trellis import TrellisCodec as TC

    c = copy.copy(cache)
    c.quantizer = "tcq"
    c.key_codec = TC(c.key_codec.dim, c.key_bits, c.rotation)
    c.value_codec = TC(c.value_codec.dim, c.value_bits, c.value_rotation)
    return c


def ours_attention(cache, wk, wv, q):
    """The entry point integration.install() routes TurboQuant caches to."""
    return turboquant_attention(q, wk, wv, cache, scale=SCALE, mask=None)


# ---------------------------------------------------------------- sections
def storage(cfg: Config) -> dict:
    """Bytes per token per KV head, counted from the arrays each method stores."""
    t = 512
    _, k, v = make_data("gaussian", t, 1, cfg.seed)
    rows = {"fp16": FP16_BYTES}
    for b in (4, 8):
        cache, _, _ = affine_cache(b, k, v)
        rows[f"affine{b}"] = cache.nbytes / (t * H_KV)
    for w in ALLOWED_KV_BITS:
        kb, vb = resolve_bits(w)
        rot = HadamardRotation(D, 0)
        n = 0
        for x, b in ((k, kb), (v, vb)):
            qv = TurboQuantCodec(D, b, rot).quantize(x)
            n += qv.packed.nbytes + qv.norms.nbytes
        rows[f"ours{w}"] = n / (t * H_KV)
        n = 0  # TCQ: the same arrays per token; 16 tokens spare the Viterbi time
        for x, b in ((k[:, :, :16], kb), (v[:, :, :16], vb)):
            qv = TrellisCodec(D, b, rot).quantize(x)
            n += qv.packed.nbytes + qv.norms.nbytes
        rows[f"tcq{w}"] = n / (16 * H_KV)
        if cfg.peer:
            cache, _, _ = peer_cache(w, k, v)
            rows[f"peer{w}"] = cache.nbytes / (t * H_KV)
    return rows


def unit_mse(cfg: Config) -> dict:
    """Per-vector squared error of random unit vectors, by bit width."""
    x = mx.random.normal((1, 1, cfg.mse_vectors, D), key=mx.random.key(cfg.seed + 7))
    x = x / mx.linalg.norm(x, axis=-1, keepdims=True)
    res = {}
    for b in (1, 2, 3, 4):
        row = {"lloyd_max": codebook(b, D).mse, "lower_bound": 4.0**-b}
        c = TurboQuantCodec(D, b, HadamardRotation(D, 3))
        row["lsq"] = float(((c.dequantize(*c.quantize(x)) - x) ** 2).sum(-1).mean())
        c = TrellisCodec(D, b, HadamardRotation(D, 3))
        row["tcq"] = float(((c.dequantize(*c.quantize(x)) - x) ** 2).sum(-1).mean())
        if cfg.peer and b >= 2:
            cache, _, _ = peer_cache(b, x, x)
            rec = cache.dequantize()[0]
            row["peer"] = float(((rec - x) ** 2).sum(-1).mean())
        res[b] = row
    return res


def inner_products(cfg: Config, k, q) -> dict:
    """Relative RMS error of q·k over keys (error / std of the true scores)."""
    G = H_Q // H_KV
    qg = q.reshape(1, H_KV, G * q.shape[2], D)
    exact = qg @ k.swapaxes(-1, -2)
    spread = float(mx.sqrt(((exact - exact.mean(-1, keepdims=True)) ** 2).mean()))
    res = {}
    for b in (2, 3, 4):
        for name, centre in (("ours", True), ("codec_only", False)):
            kh, _ = ours_reconstruct(k, k[:, :, :1], b, 2, centre=centre)
            err = qg @ kh.swapaxes(-1, -2) - exact
            res[f"{name}{b}"] = float(mx.sqrt((err**2).mean())) / spread
        if cfg.peer:
            cache, _, _ = peer_cache(b, k, k)
            kh = cache.dequantize()[0]
            err = qg @ kh.swapaxes(-1, -2) - exact
            res[f"peer{b}"] = float(mx.sqrt((err**2).mean())) / spread
    return res


def attention_quality(cfg: Config, kind: str) -> dict:
    """1 - cosine of the attention output vs float32 SDPA on float32 K/V."""
    q, k, v = make_data(kind, cfg.quality_tokens, cfg.n_queries, cfg.seed)
    ref = sdpa(q, k, v)
    res = {"fp16": one_minus_cos(sdpa(q, k.astype(mx.float16), v.astype(mx.float16)), ref)}
    for b in (4, 8):
        _, qk, qv = affine_cache(b, k, v)
        res[f"affine{b}"] = one_minus_cos(affine_attention(b, qk, qv, q), ref)
    for w in ALLOWED_KV_BITS:
        kb, vb = resolve_bits(w)
        for name, centre in (("ours", True), ("codec_only", False)):
            kh, vh = ours_reconstruct(k, v, kb, vb, centre)
            res[f"{name}{w}"] = one_minus_cos(sdpa(q, kh, vh), ref)
        for name, centre in (("tcq", True), ("tcq_codec_only", False)):
            if name == "tcq_codec_only" and not cfg.tcq_codec_only:
                continue
            kh, vh = ours_reconstruct(k, v, kb, vb, centre, quantizer="tcq")
            res[f"{name}{w}"] = one_minus_cos(sdpa(q, kh, vh), ref)
        if cfg.peer:
            # Quality from the peer's own reconstruction through the same SDPA
            # (cheap for many queries); its attention entry point is checked
            # against that on the first query.
            cache, kp, vp = peer_cache(w, k, v)
            kh, vh = peer_reconstruct(cache)
            res[f"peer{w}"] = one_minus_cos(sdpa(q, kh, vh), ref)
            direct = peer_attention(cache, kp, vp, q[:, :, :1])
            res[f"peer_direct_vs_recon{w}"] = one_minus_cos(direct, sdpa(q[:, :, :1], kh, vh))
        if w in (2.5, 3.5):  # same bytes, the extra bit on keys instead of values
            kh, vh = ours_reconstruct(k, v, vb, kb)
            res[f"ours_swapped{w}"] = one_minus_cos(sdpa(q, kh, vh), ref)
        try:  # the shipped cache + attention path (exact window included)
            cache, wk, wv = ours_cache(w, k, v)
            res[f"system{w}"] = one_minus_cos(ours_attention(cache, wk, wv, q), ref)
            cache, wk, wv = ours_cache(w, k, v, window=0)
            res[f"system_nowindow{w}"] = one_minus_cos(ours_attention(cache, wk, wv, q), ref)
            if cfg.tcq_system:
                cache, wk, wv = ours_cache(w, k, v, quantizer="tcq")
                res[f"system_tcq{w}"] = one_minus_cos(ours_attention(cache, wk, wv, q), ref)
        except ImportError as e:
            cfg.notes.append(f"cache/attention path not measured: {e}")
    return res


def quantize_timing(cfg: Config) -> dict:
    """Seconds to quantize ``quantize_vectors`` vectors (d=128): scalar vs TCQ codec."""
    x = mx.random.normal((1, H_KV, cfg.quantize_vectors // H_KV, D), key=mx.random.key(cfg.seed + 11))
    mx.eval(x)
    res = {}
    for b in (2, 3, 4):
        rot = HadamardRotation(D, 5)
        for name, c in (("scalar", TurboQuantCodec(D, b, rot)), ("tcq", TrellisCodec(D, b, rot))):
            mx.eval(*c.quantize(x))  # warm up (compilation)
            res[f"{name}{b}"] = _median_time(lambda c=c: tuple(c.quantize(x)), 3)
    return res


def _median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def decode_timing(cfg: Config) -> dict:
    """Seconds per decode-attention call at each context, medians of interleaved reps."""
    res = {}
    for T in cfg.contexts:
        q, k, v = make_data("gaussian", T, 1, cfg.seed + T)
        k16, v16, q16 = k.astype(mx.float16), v.astype(mx.float16), q.astype(mx.float16)
        mx.eval(k16, v16, q16)
        fns = {
            "fp16": lambda: sdpa(q16, k16, v16),
            "fp32": lambda: sdpa(q, k, v),
        }
        if T <= cfg.affine_max_context:
            for b in (4, 8):
                _, qk, qv = affine_cache(b, k, v)
                fns[f"affine{b}"] = lambda b=b, qk=qk, qv=qv: affine_attention(b, qk, qv, q)
        else:
            cfg.notes.append(
                f"affine decode timed only up to {cfg.affine_max_context} tokens "
                "(its CPU float16 path takes seconds per call beyond)"
            )
        for w in ALLOWED_KV_BITS:
            try:
                c, wk, wv = ours_cache(w, k, v)
                fns[f"ours{w}"] = lambda c=c, wk=wk, wv=wv: ours_attention(c, wk, wv, q)
                ct = tcq_cache_like(c)
                fns[f"tcq{w}"] = lambda c=ct, wk=wk, wv=wv: ours_attention(c, wk, wv, q)
            except ImportError as e:
                cfg.notes.append(f"decode timing of ours skipped: {e}")
                break
        if cfg.peer:
            for w in ALLOWED_KV_BITS:
                c, kp, vp = peer_cache(w, k, v)
                fns[f"peer{w}"] = lambda c=c, kp=kp, vp=vp: peer_attention(c, kp, vp, q)
        for fn in fns.values():  # warm up (compilation, first-touch)
            mx.eval(fn())
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(cfg.reps):
            for name, fn in fns.items():
                times[name].append(_median_time(fn, 1))
        res[T] = {name: statistics.median(ts) for name, ts in times.items()}
        del fns
    return res


# ---------------------------------------------------------------- report
def _width_rows(log, r: dict, cells) -> None:
    """One table row per kv width: ``cells(g)`` formats the columns, with
    ``g(name)`` the result ``r[f"{name}{width}"]`` (NaN when missing)."""
    for w in ALLOWED_KV_BITS:
        log(f"  {w:>7} " + cells(lambda n, w=w: r.get(f"{n}{w}", float("nan"))))


def run(cfg: Config, log=print) -> dict:
    t_start = time.perf_counter()

    def section(title: str) -> None:
        log(f"\n## {title}   [t={time.perf_counter() - t_start:.0f}s]")

    log(f"# benchmarks.codec  d={D}, {H_Q} query heads, {H_KV} KV heads, "
        f"mlx {mx.__version__}, {platform.machine()}, device {mx.default_device()}")
    st = storage(cfg)
    section("Storage: bytes per token (per KV head | per layer of 8 KV heads), reduction vs fp16")
    for name, b in st.items():
        log(f"  {name:>10}: {b:7.2f} B | {b * H_KV:7.1f} B   {100 * (1 - b / FP16_BYTES):5.1f}%")

    mse = unit_mse(cfg)
    section("Unit-vector MSE (per vector, d=128): stored codec vs Lloyd-Max vs 4^-b")
    for b, r in mse.items():
        peer = f"  peer {r['peer']:.5f}" if "peer" in r else ""
        log(f"  b={b}: lsq {r['lsq']:.5f}  tcq {r['tcq']:.5f} ({r['tcq'] / r['lsq']:.3f}x lsq)  "
            f"lloyd-max {r['lloyd_max']:.5f}  bound {r['lower_bound']:.5f}{peer}")

    q, k, _ = make_data("outlier", cfg.quality_tokens, cfg.n_queries, cfg.seed)
    ip = inner_products(cfg, k, q)
    section("Key inner-product error on outlier keys (RMS error / spread of true scores)")
    log("  " + "  ".join(f"{n} {e:.4f}" for n, e in ip.items()))

    quality = {}
    for kind in ("gaussian", "outlier"):
        quality[kind] = attention_quality(cfg, kind)
        section(f"Attention output 1-cos vs fp32 ({kind} K/V, T={cfg.quality_tokens}, "
            f"{cfg.n_queries} decode queries x {H_Q} heads)")
        r = quality[kind]
        log(f"  fp16 {r['fp16']:.2e}  affine4 {r['affine4']:.2e}  affine8 {r['affine8']:.2e}")
        log(f"  {'kv_bits':>7} {'ours':>9} {'codec':>9} "
            f"{'peer':>9} {'ours/peer':>9} {'system':>9} {'sys_nowin':>9}")
        _width_rows(log, r, lambda g: (
            f"{g('ours'):9.5f} {g('codec_only'):9.5f} "
            f"{g('peer'):9.5f} {g('ours') / g('peer'):9.3f} "
            f"{g('system'):9.5f} {g('system_nowindow'):9.5f}"))
        log(f"  {'kv_bits':>7} {'tcq':>9} {'tcq/peer':>9} {'tcq/ours':>9} {'tcq_codec':>9} "
            f"{'sys_tcq':>9}   (TCQ: trellis-coded, same bytes)")
        _width_rows(log, r, lambda g: (
            f"{g('tcq'):9.5f} {g('tcq') / g('peer'):9.3f} {g('tcq') / g('ours'):9.3f} "
            f"{g('tcq_codec_only'):9.5f} {g('system_tcq'):9.5f}"))
        sw = "  ".join(f"{w}: {r[f'ours_swapped{w}']:.5f}" for w in (2.5, 3.5))
        log(f"  same bytes, extra bit on keys (k3/v2, k4/v3): {sw}")
        if cfg.peer:
            dev = max(r[f"peer_direct_vs_recon{w}"] for w in ALLOWED_KV_BITS)
            log(f"  peer attention entry point vs SDPA on its reconstruction: max 1-cos {dev:.1e}")

    qt = quantize_timing(cfg) if cfg.timing else {}
    if qt:
        section(f"Quantize time, {cfg.quantize_vectors} vectors of d={D}: scalar vs TCQ codec")
        for b in (2, 3, 4):
            log(f"  b={b}: scalar {1e3 * qt[f'scalar{b}']:7.1f} ms   tcq {1e3 * qt[f'tcq{b}']:8.1f} ms"
                f"   ({qt[f'tcq{b}'] / qt[f'scalar{b}']:.0f}x)")

    timing = decode_timing(cfg) if cfg.timing else {}
    if timing:
        section("Decode attention, ms per token (ratio vs fp16 SDPA | vs fp32 SDPA)")
        for T, r in timing.items():
            log(f"  T={T}: fp16 {1e3 * r['fp16']:.1f} ms, fp32 {1e3 * r['fp32']:.1f} ms")
            for name, t in r.items():
                if name in ("fp16", "fp32"):
                    continue
                log(f"    {name:>9}: {1e3 * t:8.1f} ms   {t / r['fp16']:5.2f}x | {t / r['fp32']:5.2f}x")

    widths = {}
    for w in ALLOWED_KV_BITS:
        kb, vb = resolve_bits(w)
        row = {
            "key_bits": kb,
            "value_bits": vb,
            "bytes_per_token": st[f"ours{w}"] * H_KV,
            "bytes_per_token_per_kv_head": st[f"ours{w}"],
            "reduction_vs_fp16": 1 - st[f"ours{w}"] / FP16_BYTES,
            "mse": (mse[kb]["lsq"] + mse[vb]["lsq"]) / 2,
            "mse_lloyd_max": (mse[kb]["lloyd_max"] + mse[vb]["lloyd_max"]) / 2,
            "mse_lower_bound": (4.0**-kb + 4.0**-vb) / 2,
            "attn_cosine": 1 - quality["gaussian"][f"ours{w}"],
            "attn_cosine_outlier": 1 - quality["outlier"][f"ours{w}"],
            "attn_cosine_codec_only": 1 - quality["gaussian"][f"codec_only{w}"],
            "attn_cosine_codec_only_outlier": 1 - quality["outlier"][f"codec_only{w}"],
        }
        if cfg.peer:
            row["peer_attn_cosine"] = 1 - quality["gaussian"][f"peer{w}"]
            row["peer_attn_cosine_outlier"] = 1 - quality["outlier"][f"peer{w}"]
            row["error_ratio_vs_peer"] = quality["gaussian"][f"ours{w}"] / quality["gaussian"][f"peer{w}"]
            row["error_ratio_vs_peer_outlier"] = (
                quality["outlier"][f"ours{w}"] / quality["outlier"][f"peer{w}"]
            )
        if timing and f"ours{w}" in timing[cfg.contexts[-1]]:
            by_ctx = {str(T): r[f"ours{w}"] / r["fp16"] for T, r in timing.items()}
            row["decode_ratio_vs_fp16"] = by_ctx[str(cfg.contexts[-1])]
            row["decode_ratio_vs_fp16_by_context"] = by_ctx
            row["decode_ratio_vs_fp32_by_context"] = {
                str(T): r[f"ours{w}"] / r["fp32"] for T, r in timing.items()
            }
        g, o = quality["gaussian"], quality["outlier"]
        tcq = {
            "bytes_per_token": st[f"tcq{w}"] * H_KV,
            "mse": (mse[kb]["tcq"] + mse[vb]["tcq"]) / 2,
            "attn_cosine": 1 - g[f"tcq{w}"],
            "attn_cosine_outlier": 1 - o[f"tcq{w}"],
        }
        if f"tcq_codec_only{w}" in g:
            tcq["attn_cosine_codec_only"] = 1 - g[f"tcq_codec_only{w}"]
            tcq["attn_cosine_codec_only_outlier"] = 1 - o[f"tcq_codec_only{w}"]
        if f"system_tcq{w}" in g:
            tcq["attn_cosine_system"] = 1 - g[f"system_tcq{w}"]
            tcq["attn_cosine_system_outlier"] = 1 - o[f"system_tcq{w}"]
        if cfg.peer:
            tcq["error_ratio_vs_peer"] = g[f"tcq{w}"] / g[f"peer{w}"]
            tcq["error_ratio_vs_peer_outlier"] = o[f"tcq{w}"] / o[f"peer{w}"]
        if timing and f"tcq{w}" in timing[cfg.contexts[-1]]:
            by_ctx = {str(T): r[f"tcq{w}"] / r["fp16"] for T, r in timing.items()}
            tcq["decode_ratio_vs_fp16"] = by_ctx[str(cfg.contexts[-1])]
            tcq["decode_ratio_vs_fp16_by_context"] = by_ctx
            tcq["decode_ratio_vs_fp32_by_context"] = {
                str(T): r[f"tcq{w}"] / r["fp32"] for T, r in timing.items()
            }
        row["tcq"] = tcq
        widths[str(w)] = row
    result = {
        "config": {"dim": D, "kv_heads": H_KV, "q_heads": H_Q, "quality_tokens": cfg.quality_tokens,
                   "contexts": list(cfg.contexts), "reps": cfg.reps, "seed": cfg.seed},
        "widths": widths,
        "storage_bytes_per_token_per_kv_head": st,
        "unit_mse": {str(b): r for b, r in mse.items()},
        "inner_product_rel_error": ip,
        "attention_one_minus_cos": quality,
        "decode_seconds": {str(T): r for T, r in timing.items()},
        "quantize_seconds": qt,
        "notes": sorted(set(cfg.notes)),
        "elapsed_s": time.perf_counter() - t_start,
    }
    for n in result["notes"]:
        log(f"note: {n}")
    log(f"\nelapsed {result['elapsed_s']:.1f} s")
    return result


def _decode_only(cfg: Config, as_json: bool) -> dict:
    """The decode-timing section alone (same data and method as the full run)."""
    t0 = time.perf_counter()
    res = decode_timing(cfg)
    print(f"# decode attention per call, contexts {cfg.contexts}, {cfg.reps} interleaved reps, "
          f"{time.perf_counter() - t0:.0f} s")
    for T, r in res.items():
        print(f"{T:>6} tokens: fp16 SDPA {1e3 * r['fp16']:.1f} ms, fp32 SDPA {1e3 * r['fp32']:.1f} ms")
        for name in sorted(n for n in r if n not in ("fp16", "fp32")):
            print(f"   {name:<9} {1e3 * r[name]:8.1f} ms  {r[name] / r['fp16']:5.2f}x fp16  "
                  f"{r[name] / r['fp32']:5.2f}x fp32")
    result = {"decode_s": {str(T): r for T, r in res.items()}}
    if as_json:
        print(json.dumps(result, default=float))
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.codec", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: under a minute on 2 CPU cores")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--contexts", type=str, default=None, help="comma-separated decode context lengths")
    ap.add_argument("--tokens", type=int, default=None, help="context length for the quality tests")
    ap.add_argument("--reps", type=int, default=None, help="timing repetitions per method")
    ap.add_argument("--queries", type=int, default=None, help="decode queries per head (quality)")
    ap.add_argument("--mse-vectors", type=int, default=None, help="unit vectors for the MSE test")
    ap.add_argument("--no-peer", action="store_true", help="skip mlx-vlm's TurboQuant")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode-only", action="store_true",
                    help="only the decode-timing section (ratios vs fp16/fp32 SDPA), e.g. after a decoder change")
    args = ap.parse_args(argv)
    cfg = Config(**QUICK) if args.quick else Config()
    if args.contexts:
        cfg.contexts = tuple(int(c) for c in args.contexts.split(","))
    for arg, name in (("tokens", "quality_tokens"), ("reps", "reps"), ("queries", "n_queries"),
                      ("mse_vectors", "mse_vectors")):
        if getattr(args, arg):
            setattr(cfg, name, getattr(args, arg))
    cfg.peer, cfg.timing, cfg.seed = not args.no_peer, not args.no_timing, args.seed
    if args.decode_only:
        return _decode_only(cfg, args.json)
    result = run(cfg)
    if args.json:
        print(json.dumps(result, default=float))
    sys.stdout.flush()
    return result


if __name__ == "__main__":
    main()
