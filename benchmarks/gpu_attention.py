"""Decode/prefill attention on the packed TurboQuant cache vs fp16 and affine 4-bit.

  python -m benchmarks.gpu_attention [--lengths 8k,32k,128k,512k,1M] [--generation 32k,128k] [--json out.json]

One run prints, for 32 query heads / 8 KV heads / head dim 128, batch 1:

* decode-attention time per token (one query token) for fp16
  ``mx.fast.scaled_dot_product_attention``, MLX affine 4-bit quantized
  attention (``mx.quantized_matmul`` on the cache, as mlx-lm's
  ``quantized_scaled_dot_product_attention`` does) and the TurboQuant kernels
  at 2.5, 3.5 and 4 bits (the split-K kernel ``route.choose`` picks; on
  CUDA also the tc and SIMT kernels), the whole decode step (fused, and the
  split-K kernel with the MLX ops around it), with the bytes of cache each
  reads and the effective bandwidth against a measured device copy rate;
* optionally (``--generation``) a generation loop: 32 dependent calls per
  token, tokens pipelined with ``mx.async_eval``;
* quantize-on-append for one token (8 heads, keys + values) vs a decode step,
  the cache's batched flush (64 tokens) amortized per step, and real decode
  steps on a TurboQuantKVCache with per-token vs batched flushing;
* chunked prefill of 128k tokens: fp16 SDPA vs the TurboQuant dispatch (the
  tensor-core kernel tiled over query rows) vs dequantize + SDPA.

Timing: every call is independent work on one of several copies of the
inputs (rotated so the working set is several times the L2 cache); a batch
of calls is evaluated at once and the per-call time is the batch time over
its size (median of repeats).  GPU only (CUDA or Metal).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import turboquant  # noqa: E402,F401  (before mlx.core)
import mlx.core as mx  # noqa: E402

from turboquant.attention import Route, turboquant_attention  # noqa: E402
from turboquant.attention.compose import dequant_sdpa_attention, split_k_attention  # noqa: E402
from turboquant.attention.device import backend  # noqa: E402
from turboquant.attention.launchers import decode, quantize  # noqa: E402
from turboquant.attention.route import split_k_route  # noqa: E402
from turboquant.codec import TurboQuantCodec  # noqa: E402
from turboquant.masks import as_5d, split_mask  # noqa: E402
from turboquant.packing import packed_words  # noqa: E402
from turboquant.policy import resolve_bits  # noqa: E402
from turboquant.rotation import HadamardRotation  # noqa: E402

HQ, HKV, D = 32, 8, 128
SCALE = D**-0.5
WORKING_SET = 512 << 20  # bytes of inputs cycled through per timing batch


def parse_len(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(s[-1], 1)
    return int(s[:-1] if s[-1] in "km" else s) * mult


def timeit(fns, repeats: int = 7, batch: int = 0) -> float:
    """Median seconds per call of ``fns`` (a list of equivalent closures on
    different input copies), evaluated ``batch`` calls at a time (at least 8,
    so the host round trip of one ``eval`` is spread over several calls)."""
    return timeit2(fns, repeats, batch)[0]


def timeit2(fns, repeats: int = 7, batch: int = 0) -> tuple[float, float]:
    """(per call with its graph build, per call evaluation only): the second
    starts the clock after the batch's graphs are built, i.e. it leaves out
    the host's Python + op construction, which a generation loop overlaps
    with the previous step's GPU work (mlx-lm evaluates asynchronously)."""
    batch = batch or max(len(fns), 8)
    mx.eval([fns[i % len(fns)]() for i in range(min(batch, len(fns)))])  # warm-up/compile
    mx.synchronize()
    total, evals = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [fns[i % len(fns)]() for i in range(batch)]
        t1 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        t2 = time.perf_counter()
        total.append((t2 - t0) / batch)
        evals.append((t2 - t1) / batch)
        del outs
    return median(total), median(evals)


def chained(step, x, caches, calls: int):
    """``calls`` dependent calls of ``step``: each takes the previous call's
    output and the next of ``caches`` in turn (as a model's layers)."""
    for i in range(calls):
        x = step(x, caches[i % len(caches)])
    return x


def median(xs: list) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def timeit_chain(step, q0, caches, batch: int, repeats: int = 5) -> float:
    """Evaluation time per call of ``batch`` dependent calls: each call's
    query is the previous call's output, as layer after layer of a model.
    Independent calls in one evaluation (``timeit2``) may run side by side
    (MLX's CUDA graphs launch independent nodes concurrently), which hides a
    latency-bound kernel's idle SMs; a decoding model cannot do that."""
    mx.eval(chained(step, q0, caches, batch))  # warm-up/compile
    mx.synchronize()
    times = []
    for _ in range(repeats):
        out = chained(step, q0, caches, batch)
        t1 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        times.append((time.perf_counter() - t1) / batch)
        del out
    return median(times)


def timeit_generation(step, q0, caches, layers: int = 32, tokens: int = 24, warm: int = 4,
                      stats: Optional[dict] = None) -> float:
    """Per-call time as mlx-lm's generation loop evaluates a model: per
    token one evaluation of ``layers`` dependent calls (a 32-layer model's
    attention), submitted with ``mx.async_eval`` before the next token's
    graph is built, and the host waits for a token only after submitting the
    next (as ``generate_step`` does for its ``.item()``).  Building and
    launching a token's graphs then overlaps the GPU work of the token
    before it, which ``timeit_chain``'s synchronous evaluations expose.

    ``stats``, if given, receives ``host``: the host's time per call spent
    building and submitting graphs, outside the wait for the token before.
    Well below the per-call time, the loop is bound by the device.  Near it,
    either the host is the limit or MLX held the submission back while
    earlier work ran (fp16 SDPA at 512k on the H200: 0.49 of 0.49 ms per
    call, yet the device is the limit there, 0.53 ms per call evaluated
    alone).  The decode table's times say which."""
    def token(x):
        return chained(step, x, caches, layers)

    x = q0
    for _ in range(warm):  # compiles, plans, and the pipeline filled
        x = token(x)
        mx.async_eval(x)
    mx.eval(x)
    mx.synchronize()
    t0 = time.perf_counter()
    host = 0.0
    prev = x
    for _ in range(tokens):
        h0 = time.perf_counter()
        x = token(prev)
        mx.async_eval(x)
        host += time.perf_counter() - h0
        mx.eval(prev)  # the host's wait for the token before (sampling it)
        prev = x
    mx.eval(x)
    mx.synchronize()
    if stats is not None:
        stats["host"] = host / (tokens * layers)
    return (time.perf_counter() - t0) / (tokens * layers)


def copy_rate() -> float:
    """Device copy bandwidth (bytes read + written per second)."""
    a = mx.random.uniform(shape=(1 << 29,))  # 2 GiB float32
    mx.eval(a)
    t = timeit([lambda: a + 1.0], repeats=9, batch=4)
    return 2 * a.nbytes / t


def copies_for(nbytes: int) -> int:
    return max(1, min(64, math.ceil(WORKING_SET / max(nbytes, 1))))


# ------------------------------------------------------------------ caches


def fp16_cache(n: int):
    k = mx.random.normal((1, HKV, n, D)).astype(mx.float16)
    v = mx.random.normal((1, HKV, n, D)).astype(mx.float16)
    mx.eval(k, v)
    return k, v


def affine_cache(k, v, bits=4, group=64):
    kq = mx.quantize(k, group_size=group, bits=bits)
    vq = mx.quantize(v, group_size=group, bits=bits)
    mx.eval(kq, vq)
    return kq, vq


def affine_attention(q, kq, vq, bits=4, group=64):
    """mlx-lm's quantized_scaled_dot_product_attention (GQA by reshaping q)."""
    B, H, L, Dq = q.shape
    q = (q * SCALE).reshape(B, HKV, H // HKV, L, Dq)
    kq = [t[:, :, None] for t in kq]
    vq = [t[:, :, None] for t in vq]
    s = mx.quantized_matmul(q, *kq, transpose=True, group_size=group, bits=bits)
    p = mx.softmax(s, axis=-1, precise=True)
    o = mx.quantized_matmul(p, *vq, transpose=False, group_size=group, bits=bits)
    return o.reshape(B, H, L, Dq)


def tq_cache(n: int, kv_bits: float, seed: int = 0, split: Optional[tuple[int, int]] = None):
    """A cache-like namespace with random packed history (what kernels read);
    ``split``: (key bits, value bits) instead of ``kv_bits``'s preset."""
    kb, vb = split or resolve_bits(kv_bits)
    rot = HadamardRotation(D, seed)
    kc, vc = TurboQuantCodec(D, kb, rot), TurboQuantCodec(D, vb, rot)
    wk, wv = packed_words(D, kb), packed_words(D, vb)
    kp = mx.random.randint(0, 1 << 31, (1, HKV, n, wk)).astype(mx.uint32)
    vp = mx.random.randint(0, 1 << 31, (1, HKV, n, wv)).astype(mx.uint32)
    kn = mx.random.uniform(0.5, 2.0, (1, HKV, n)).astype(mx.float16)
    vn = mx.random.uniform(0.5, 2.0, (1, HKV, n)).astype(mx.float16)
    mx.eval(kp, vp, kn, vn)
    return SimpleNamespace(
        keys_packed=kp, keys_norms=kn, values_packed=vp, values_norms=vn,
        key_codec=kc, value_codec=vc, rotation=rot, value_rotation=rot,
        # centred as a real cache is after its first flush (zero means: any values time the same)
        key_mean=mx.zeros((1, HKV, 1, D)), value_mean=mx.zeros((1, HKV, 1, D)),
        key_mean_pre=None, key_scale=None, rotary=None,
        packed_len=n, sink_len=0,
        nbytes=kp.nbytes + vp.nbytes + kn.nbytes + vn.nbytes,
        observe_queries=lambda queries: None,  # calibrated already: the attention reads, never tunes
    )


def tq_caches(n: int, kv_bits: float, most: Optional[int] = None, split: Optional[tuple[int, int]] = None) -> list:
    """``tq_cache``s of distinct seeds to cycle through (``copies_for`` their
    bytes, at most ``most``), so that no call finds its cache in L2."""
    c0 = tq_cache(n, kv_bits, split=split)
    k = copies_for(c0.nbytes) if most is None else min(most, copies_for(c0.nbytes))
    return [c0] + [tq_cache(n, kv_bits, seed=i + 1, split=split) for i in range(k - 1)]


def tq_cache_bytes(n: int, kv_bits: float) -> int:
    """Bytes of a packed cache of n tokens (codes + float16 norms, K and V)."""
    kb, vb = resolve_bits(kv_bits)
    return HKV * n * 4 * (packed_words(D, kb) + packed_words(D, vb) + 1)


def tq_decode_fn(c, q_rot, route: Route | None = None):
    """The split-K kernel alone (``route``: default, the one ``choose`` runs)."""
    kc, vc = c.key_codec, c.value_codec
    route = route or split_k_route(backend(), D, c.keys_norms.shape[2], q_rot.shape[2])
    return lambda: decode(
        q_rot, c.keys_packed, c.keys_norms, c.values_packed, c.values_norms,
        kc.centroids, vc.centroids, c.packed_len, kc.bits, vc.bits, route,
    )[0]


def fp16_step(x, kv):
    """fp16 SDPA of queries ``x`` over one (keys, values) cache: the baseline
    of every table."""
    return mx.fast.scaled_dot_product_attention(x, kv[0], kv[1], scale=SCALE)


def window_keys() -> mx.array:
    """The exact fp16 window (128 recent tokens, used as keys and values)
    that the whole-step rows attend besides the packed history."""
    return mx.random.normal((1, HKV, 128, D)).astype(mx.float16)


def whole_step(wk):
    """``step(x, cache)``: the decode attention step as a model calls it,
    ``turboquant_attention`` over a packed cache and the window ``wk``."""
    return lambda x, c: turboquant_attention(x, wk, wk, c, SCALE, None)


def split_k_step(wk):
    """``step(x, cache)``: the same step through the split-K kernel (tc8 on
    CUDA) and the ~20 MLX ops around it, instead of the fused launch."""
    return lambda x, c: split_k_attention(x, wk, wk, c, SCALE, None, Route.TC8 if backend() == "cuda" else Route.SIMT)


# ------------------------------------------------------------------ sections


def bench_decode(lengths, results, bw):
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.float16)
    q_rot = (q.astype(mx.float32) * SCALE).reshape(1, HKV, HQ // HKV, D)
    hdr = (f"{'tokens':>8} {'method':<22} {'ms/token':>9} {'MB read':>9} {'vs fp16':>8}"
           f" {'eval ms':>8} {'vs fp16':>8} {'chain ms':>9} {'vs fp16':>8} {'GB/s':>6} {'% copy':>7}")
    print("\n== decode attention, 32 q heads / 8 kv heads / d=128, batch 1, one query token")
    print("   ms/token: independent calls, graph build included; eval ms: the same batch, evaluation only;")
    print("   chain ms: evaluation only, each call's query = the previous call's output (as a model's layers);")
    print("   GB/s and % copy (of the copy rate above) from chain ms")
    print(hdr)
    for n in lengths:
        row = {}
        # One batch size for every method at this length (the largest copy
        # count, i.e. the smallest cache's): the per-evaluation overhead is
        # then spread over the same number of calls for everyone.
        batch = max(8, copies_for(tq_cache_bytes(n, 2.5)))
        k, v = fp16_cache(n)
        nb = k.nbytes + v.nbytes
        cs = [(k, v)] + [fp16_cache(n) for _ in range(copies_for(nb) - 1)]
        t = timeit2([lambda c=c: fp16_step(q, c) for c in cs], batch=batch)
        row["fp16 sdpa"] = (t, timeit_chain(fp16_step, q, cs, batch), nb)
        aq = [affine_cache(*c) for c in cs]
        anb = sum(a.nbytes for a in aq[0][0]) + sum(a.nbytes for a in aq[0][1])
        del cs
        try:
            t = timeit2([lambda a=a: affine_attention(q, *a) for a in aq], batch=batch)
            row["affine 4-bit (mlx)"] = (t, timeit_chain(lambda x, a: affine_attention(x, *a), q, aq, batch), anb)
        except Exception as e:  # noqa: BLE001
            print(f"  affine failed at {n}: {e}")
        del aq, k, v
        for kv_bits in (2.5, 3.5, 4):
            cs = tq_caches(n, kv_bits)
            c0 = cs[0]

            def kernel_step(x, c):
                return tq_decode_fn(c, x)()

            t = timeit2([tq_decode_fn(c, q_rot) for c in cs], batch=batch)
            row[f"turboquant {kv_bits}-bit"] = (t, timeit_chain(kernel_step, q_rot, cs, batch), c0.nbytes)
            if kv_bits == 3.5 and backend() == "cuda":  # the other kernels, as arguments
                for route, label in ((Route.TC, "tq 3.5 tc16 kernel"), (Route.SIMT, "tq 3.5 simt kernel")):
                    t = timeit2([tq_decode_fn(c, q_rot, route) for c in cs], batch=batch)
                    row[label] = (t, timeit_chain(lambda x, c, r=route: tq_decode_fn(c, x, r)(), q_rot, cs, batch),
                                  c0.nbytes)
            if kv_bits == 3.5:  # whole attention: rotations, 128-token window, merge
                wk = window_keys()
                for label, step in (("tq 3.5 whole step", whole_step(wk)),
                                    ("tq 3.5 step, op-by-op", split_k_step(wk))):
                    full = [lambda c=c, s=step: s(q, c) for c in cs]
                    row[label] = (timeit2(full, batch=batch), timeit_chain(step, q, cs, batch),
                                  c0.nbytes + 2 * wk.nbytes)
            del cs, c0
        (base, base_e), base_c, _ = row["fp16 sdpa"]
        for name, ((t, te), tc, nbytes) in row.items():
            print(f"{n:>8} {name:<22} {t * 1e3:>9.4f} {nbytes / 1e6:>9.1f} {base / t:>7.2f}x"
                  f" {te * 1e3:>8.4f} {base_e / te:>7.2f}x {tc * 1e3:>9.4f} {base_c / tc:>7.2f}x"
                  f" {nbytes / tc / 1e9:>6.0f} {100 * nbytes / tc / bw:>6.1f}%")
        results.setdefault("decode", {})[n] = {k_: {"s": t, "eval_s": te, "chain_s": tc, "bytes": b}
                                               for k_, ((t, te), tc, b) in row.items()}
        mx.clear_cache()


def bench_generation(lengths, results, layers: int = 32):
    """fp16 SDPA and the one-launch step timed as a generation loop runs
    them (``timeit_generation``): 32 dependent calls per token, tokens
    pipelined with ``mx.async_eval``.  Caches cycle as in the decode table,
    so that no call finds its cache in L2."""
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.float16)
    wk = window_keys()
    step = whole_step(wk)
    print(f"\n== generation loop: {layers} dependent calls per token, tokens pipelined with mx.async_eval"
          " (ms per call)")
    out = {}
    for n in lengths:
        k, v = fp16_cache(n)
        nb = k.nbytes + v.nbytes
        cs = [(k, v)] + [fp16_cache(n) for _ in range(min(layers, copies_for(nb)) - 1)]
        h16, htq = {}, {}
        t16 = timeit_generation(fp16_step, q, cs, layers, stats=h16)
        del cs, k, v
        cs = tq_caches(n, 3.5, most=layers)
        ttq = timeit_generation(step, q, cs, layers, stats=htq)
        nbytes = cs[0].nbytes + 2 * wk.nbytes
        del cs
        # the same bytes split the other way (3-bit keys, 4-bit values): the
        # kernels' speed at equal bytes, whatever the preset's split
        cs = tq_caches(n, 3.5, most=layers, split=(3, 4))
        t34 = timeit_generation(step, q, cs, layers)
        del cs
        out[n] = {"fp16 sdpa": t16, "tq 3.5 whole step": ttq, "tq k3v4 whole step": t34, "bytes": nbytes,
                  "host": {"fp16 sdpa": h16["host"], "tq 3.5 whole step": htq["host"]}}
        print(f"  {n:>8} tokens: fp16 sdpa {t16 * 1e3:.4f}  tq 3.5 whole step {ttq * 1e3:.4f}"
              f"  ({t16 / ttq:.2f}x; {nbytes / ttq / 1e9:.0f} GB/s);  host build + submit"
              f" {h16['host'] * 1e3:.4f} / {htq['host'] * 1e3:.4f};  3/4 split {t34 * 1e3:.4f}"
              f" (3.5 preset at {t34 / ttq:.2f}x its speed)")
        mx.clear_cache()
    results["generation"] = out


def bench_append(n, results):
    """Quantize-on-append of one decode token (8 heads, K and V) vs a decode step."""
    c = tq_cache(n, 3.5)
    q_rot = mx.random.normal((1, HKV, HQ // HKV, D)) * SCALE
    x = [mx.random.normal((1, HKV, 1, D)).astype(mx.float16) for _ in range(16)]
    kc, vc = c.key_codec, c.value_codec
    t_step = timeit([tq_decode_fn(c, q_rot)], batch=16)
    t_kernel = timeit([lambda xi=xi: quantize(xi, kc) + quantize(xi, vc) for xi in x])
    t_ref = timeit([lambda xi=xi: tuple(kc.quantize(xi)) + tuple(vc.quantize(xi)) for xi in x])
    print(f"\n== quantize-on-append, 1 token x 8 heads, keys (3-bit) + values (4-bit), at {n} tokens")
    print(f"  fused kernel      {t_kernel * 1e3:.4f} ms  = {100 * t_kernel / t_step:.1f}% of a decode step ({t_step * 1e3:.4f} ms)")
    print(f"  reference codec   {t_ref * 1e3:.4f} ms  = {100 * t_ref / t_step:.1f}%")
    xb = mx.random.normal((1, HKV, 4096, D)).astype(mx.float16)
    t_chunk = timeit([lambda: quantize(xb, kc) + quantize(xb, vc)], batch=8)
    t_chunk_ref = timeit([lambda: tuple(kc.quantize(xb)) + tuple(vc.quantize(xb))], batch=8)
    print(f"  4096-token chunk: kernel {t_chunk * 1e3:.3f} ms, reference codec {t_chunk_ref * 1e3:.3f} ms")
    results["append"] = {"kernel": t_kernel, "reference": t_ref, "decode_step": t_step,
                         "chunk_kernel": t_chunk, "chunk_reference": t_chunk_ref}
    # The cache quantizes decode tokens in batches of flush_batch (default 64
    # = window // 2): one launch pair per 64 steps.
    fb = 64
    xf = [mx.random.normal((1, HKV, fb, D)).astype(mx.float16) for _ in range(8)]
    t_flush = timeit([lambda xi=xi: quantize(xi, kc) + quantize(xi, vc) for xi in xf])
    print(f"  flush of {fb} tokens (the cache's batch): {t_flush * 1e3:.4f} ms = "
          f"{t_flush / fb * 1e3:.5f} ms per decode step = {100 * t_flush / fb / t_step:.2f}% of a decode step")
    results["append"].update(flush_batch=fb, flush=t_flush, amortized=t_flush / fb)
    decode_loop(n, results)


def decode_loop(n, results, steps=256):
    """Real decode steps on a TurboQuantKVCache holding n tokens: append one
    token (update_and_fetch, which flushes to packed storage) + attention,
    evaluated per step as generation does.  flush_batch=1 quantizes every
    token as it leaves the window; the default batches 64."""
    from turboquant.cache import TurboQuantKVCache

    ks = [mx.random.normal((1, HKV, 1, D)).astype(mx.float16) for _ in range(steps)]
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.float16)
    out, cold = {}, {}
    for name, fb in (("flush every token", 1), ("flush batch 64 (default)", None)):
        c = TurboQuantKVCache(3.5, window=128, flush_batch=fb, seed=0)
        c.reserve(n + steps + 1)
        for a in range(0, n, 8192):
            x = mx.random.normal((1, HKV, min(8192, n - a), D)).astype(mx.float16)
            c.update_and_fetch(x, x)
            mx.eval(c.keys_packed, c.values_packed, c.window_keys)
        times = []
        try:
            for rep in range(3):
                ck = c.checkpoint()
                mx.synchronize()
                t0 = time.perf_counter()
                for k in ks:
                    wk, wv = c.update_and_fetch(k, k)
                    mx.eval(turboquant_attention(q, wk, wv, c, SCALE, None))
                mx.synchronize()
                times.append((time.perf_counter() - t0) / steps)
                c.restore(ck)
        except Exception as e:  # noqa: BLE001
            print(f"  decode loop '{name}' failed: {e}")
            continue
        out[name] = min(times[1:])
        cold[name] = times[0]
    base = out.get("flush batch 64 (default)") or next(iter(out.values()), 1.0)
    print(f"\n== decode steps on a TurboQuantKVCache at {n} tokens (3.5-bit, window 128): "
          f"append + attention, eval per step, {steps} steps (first pass: includes building the plan)")
    for name, t in out.items():
        print(f"  {name:<26} {t * 1e3:.4f} ms/step  ({t / base:.2f}x)   first pass {cold[name] * 1e3:.4f} ms/step")
    results["decode_loop"] = {"tokens": n, **out, "first_pass": cold}


def bench_prefill(n, chunk, results):
    """Chunked prefill of n tokens: fp16 SDPA over the growing cache vs the
    TurboQuant attention dispatch (what ``route.choose`` picks: on CUDA a
    chunk of ``PREFILL_SDPA_ROWS`` rows or more dequantizes the history for
    one SDPA while the temporary fits) + quantizing the chunk; also each
    CUDA route forced: the tensor-core kernel over the packed history
    (tiled by query rows, merged with the chunk's exact attention) and
    dequantize + SDPA."""
    kc_bits = 3.5
    k_all, v_all = fp16_cache(n)
    qs = mx.random.normal((1, HQ, chunk, D)).astype(mx.float16)
    tq = tq_cache(n, kc_bits)

    def fp16_step(e):
        return mx.fast.scaled_dot_product_attention(
            qs, k_all[:, :, :e], v_all[:, :, :e], scale=SCALE, mask="causal")

    def tq_step(s, attend):
        tq.packed_len = s
        wk = k_all[:, :, s : s + chunk]
        wv = v_all[:, :, s : s + chunk]
        if s == 0:
            o = mx.fast.scaled_dot_product_attention(qs, wk, wv, scale=SCALE, mask="causal")
        else:
            o = attend(qs, wk, wv, tq, SCALE, "causal")
        pk = quantize(wk, tq.key_codec)
        pv = quantize(wv, tq.value_codec)
        return [o, *pk, *pv]

    def tc_kernel(q, wk, wv, c, scale, mask):
        _, window_mask = split_mask(mask, q.shape[2], c.packed_len, wk.shape[2], c.sink_len)
        return split_k_attention(q, wk, wv, c, scale, as_5d(window_mask, 1, HKV, HQ // HKV), Route.TC)

    out, peak = {}, {}
    steps = [
        ("fp16", lambda s: [fp16_step(s + chunk)]),
        ("turboquant 3.5-bit", lambda s: tq_step(s, turboquant_attention)),
        ("tq 3.5 dequant+SDPA", lambda s: tq_step(s, dequant_sdpa_attention)),
    ]
    if backend() == "cuda":
        steps.append(("tq 3.5 tc kernel", lambda s: tq_step(s, tc_kernel)))
    for name, step in steps:
        mx.eval(step(0), step(chunk))  # compile/warm
        mx.synchronize()
        mx.reset_peak_memory()
        base_mem = mx.get_active_memory()
        total = 0.0
        for s in range(0, n, chunk):
            # each chunk timed on its second call: MLX's CUDA SDPA plans every
            # new key length once (~35 ms), a plan a model's layers share
            mx.eval(step(s))
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval(step(s))
            mx.synchronize()
            total += time.perf_counter() - t0
        out[name] = total
        peak[name] = mx.get_peak_memory() - base_mem
    print(f"\n== chunked prefill attention, {n} tokens in chunks of {chunk} (32/8 heads, d=128)")
    for name, t in out.items():
        print(f"  {name:<20} {t:8.3f} s  ({t / out['fp16']:.2f}x fp16)  peak above inputs {peak[name] / 2**20:8.1f} MiB")
    results["prefill"] = {"tokens": n, "chunk": chunk, **out, "peak_bytes": peak}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="8k,32k,128k,512k,1M")
    ap.add_argument("--generation", default="none",
                    help="lengths for the generation-loop timing (async_eval, 32 calls per token; 'none' = skip)")
    ap.add_argument("--prefill", default="128k", help="prefill length ('none' = skip)")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    be = backend()
    if be is None:
        print("gpu_attention: needs a GPU (MLX with Metal or CUDA)", file=sys.stderr)
        return 2
    print(f"backend: {be}, mlx {mx.__version__}, device {mx.default_device()}")
    results = {"backend": be}
    bw = copy_rate()
    results["copy_Bps"] = bw
    print(f"device copy rate (read + write): {bw / 1e12:.2f} TB/s")
    bench_decode([parse_len(s) for s in args.lengths.split(",") if s], results, bw)
    if args.generation not in ("", "none"):
        bench_generation([parse_len(x) for x in args.generation.split(",") if x], results)
    bench_append(parse_len("32k"), results)
    if args.prefill not in ("", "none"):
        try:
            bench_prefill(parse_len(args.prefill), args.chunk, results)
        except Exception as e:  # noqa: BLE001
            print(f"prefill benchmark failed: {e}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
