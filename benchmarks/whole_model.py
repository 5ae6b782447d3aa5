"""Whole-model decode speed and memory of the 8B shape, per context and cache.

    python -m benchmarks.whole_model --json OUT.json [--contexts 32768,131072,524288,1048576]
        [--caches bf16,turboquant-2.5,turboquant-3.5,turboquant-4,affine-4] [--shape 8b] [--tokens 64]
        (also turboquant-kKvV: explicit key/value widths, e.g. turboquant-k3v4; a TurboQuant
        name + "/constant-mean": keys on one constant mean, no per-block RoPE term, the baseline
        of the block mean's cost)
    python -m benchmarks.whole_model --tiny --json OUT.json     # CPU smoke (CI): tiny shape, short contexts

Model: ``scripts/build_model.py``'s architecture (``--shape``: Llama-3.1-8B
by default; 32 layers, 32 q / 8 kv heads, d=128), seeded random weights in
bf16 built in memory (float32 with ``--tiny``: MLX's CPU half matmul is slow).

Per (context, cache) one row:

* ``decode_tok_s``: the engine's own decode loop (``Engine.run_task``, the
  asynchronous loop of ``pipeline.decode``) over ``--tokens`` tokens, EOS
  off, on a cache holding ``context`` tokens;
* ``generate_step_tok_s``: mlx-lm's ``generate_step`` on the same model and
  the same cache (rewound between the two), tokens after the first;
* ``ttft_s``: time to first token of a real chunked prefill through the
  engine (``Engine.prefill`` + the task suffix + first sample) for contexts
  up to ``--ttft-max`` (default 131072), after an untimed prefill of two
  chunks (so kernel builds and first launches count in no row, whichever
  runs first), else null: longer caches are filled
  with random keys/values layer by layer (``update_and_fetch`` in chunks),
  which costs what a prefill's cache writes cost but skips its attention;
* ``kv_bytes``: the cache's bytes for its tokens; ``peak_bytes``: MLX's peak
  memory during the row (weights + cache + temporaries);
* ``fits``: false (and no timings) where weights + cache would not fit
  ``HEADROOM`` of the device memory, judged from the bytes per token of a
  small fill before any long row runs; ``max_context`` per cache: the
  largest context that fits, from the bytes per token of its longest row.

The JSON: ``{"rows": [...], "max_context": {cache: tokens}, "meta": {...}}``;
each row has ``context``, ``cache`` (``bf16``, ``turboquant-2.5``, ...),
``decode_tok_s``, ``generate_step_tok_s``, ``ttft_s``, ``kv_bytes``,
``peak_bytes``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import turboquant  # noqa: F401  (fast CPU BLAS before mlx.core)
import mlx.core as mx

REPO = Path(__file__).resolve().parents[1]
CACHES = ("bf16", "turboquant-2.5", "turboquant-3.5", "turboquant-4", "affine-4")
CONTEXTS = (32768, 131072, 524288, 1048576)
TINY_CONTEXTS = (512, 1536)
FILL_CHUNK = 8192  # tokens per synthetic cache write (per layer)
HEADROOM = 0.92  # share of device memory a run may plan to use


SPLIT_CACHE = re.compile(r"turboquant-k([1-4])v([1-4])")  # explicit key/value widths, e.g. turboquant-k3v4
CONSTANT_MEAN = "/constant-mean"  # suffix: TurboQuant keys on one constant mean (no block term)


def known_cache(cache: str) -> bool:
    base, constant = _base(cache)
    return (base in CACHES or SPLIT_CACHE.fullmatch(base) is not None) and (
        not constant or base.startswith("turboquant"))


def _base(cache: str) -> tuple[str, bool]:
    """(the cache name without the constant-mean suffix, whether it had it)."""
    return (cache[: -len(CONSTANT_MEAN)], True) if cache.endswith(CONSTANT_MEAN) else (cache, False)


def cache_order(cache: str) -> tuple[int, str]:
    base = _base(cache)[0]
    return (CACHES.index(base) if base in CACHES else len(CACHES), cache)


@contextmanager
def key_centring(cache: str):
    """While a ``/constant-mean`` row runs, its TurboQuant caches get no RoPE
    angles, so keys keep one constant mean and the kernels no per-block
    score term: the same bytes and codes, without the term's cost."""
    import turboquant.prompt_cache as pc

    if not _base(cache)[1]:
        yield
        return
    real = pc._layer_rotaries
    pc._layer_rotaries = lambda model: {}
    try:
        yield
    finally:
        pc._layer_rotaries = real


def cache_spec(cache: str, chunk: int):
    """The job's ``CacheSpec`` for a row's cache name."""
    from pipeline.schema.job import CacheSpec

    cache = _base(cache)[0]
    if cache == "bf16":
        return CacheSpec(kv_quant_scheme="fp16", prefill_chunk=chunk)
    split = SPLIT_CACHE.fullmatch(cache)
    if split:
        return CacheSpec(kv_quant_scheme="turboquant", key_bits=int(split[1]), value_bits=int(split[2]),
                         prefill_chunk=chunk)
    scheme, bits = cache.split("-")
    return CacheSpec(kv_quant_scheme=scheme, kv_bits=float(bits), prefill_chunk=chunk)


def build_model(shape: str, dtype: mx.Dtype, seed: int = 0):
    """An mlx-lm llama of ``scripts/build_model.py``'s ``shape``, random weights, evaluated layer by layer."""
    sys.path.insert(0, str(REPO / "scripts"))
    from build_model import config_for
    from mlx_lm.models import llama

    mx.random.seed(seed)
    cfg = config_for(shape)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    for _, m in model.named_modules():  # cast module by module: no float32 copy of the whole model
        for k, v in m.parameters().items():
            if isinstance(v, mx.array) and v.dtype != dtype:
                setattr(m, k, v.astype(dtype))
                mx.eval(getattr(m, k))
    mx.eval(model.parameters())
    return model, cfg


class _NoTextTokenizer:
    """The engine only decodes ids to text for the record; none here, no EOS."""

    def decode(self, ids):
        return ""


def _fill(cache: list, cfg: dict, n: int, dtype: mx.Dtype) -> None:
    """Append ``n`` random key/value tokens to every layer's cache (as if
    64 query rows per head had been seen before them)."""
    h_kv = cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for c in cache:
        if hasattr(c, "reserve"):
            c.reserve(n + 4096)
        if hasattr(c, "add_query_energy"):  # unit-variance queries: the first flush scales the keys, as a prefill's would
            c.add_query_energy(mx.full((1, h_kv, d), 64.0), 64)
    for a in range(0, n, FILL_CHUNK):
        m = min(FILL_CHUNK, n - a)
        for i, c in enumerate(cache):
            k = mx.random.normal((1, h_kv, m, d), key=mx.random.key(2 * (a + i))).astype(dtype)
            v = mx.random.normal((1, h_kv, m, d), key=mx.random.key(2 * (a + i) + 1)).astype(dtype)
            c.update_and_fetch(k, v)
        mx.eval([c.state for c in cache])
    mx.clear_cache()


def _state(engine, n: int):
    """The engine's prefill record for an already filled cache (synthetic rows)."""
    from pipeline.inference.engine import _Prefilled

    st = _Prefilled(length=n, prefill_s=0.0, nbytes=engine.cache_nbytes(), pos_delta=None)
    st.windows = [c.checkpoint() if hasattr(c, "checkpoint") else None for c in engine.cache]
    return st


def _generate_step_tok_s(engine, tokens: int) -> float:
    """mlx-lm's generate_step on the engine's cache (held like a task: nothing flushed)."""
    from mlx_lm.generate import generate_step

    for c in engine.cache:
        if hasattr(c, "hold"):
            c.hold = True
    prompt = mx.array([5, 6, 7], dtype=mx.int32)
    t0, n = None, 0
    for n, _ in enumerate(generate_step(prompt, engine.loaded.model, max_tokens=tokens + 1,
                                        prompt_cache=engine.cache), start=1):
        if n == 1:
            t0 = time.perf_counter()
    return (n - 1) / (time.perf_counter() - t0)


def measure_row(model, cfg: dict, context: int, cache: str, *, tokens: int, chunk: int, ttft_max: int,
                dtype: mx.Dtype) -> dict:
    """One (context, cache) row; see the module docstring."""
    from pipeline.inference.prompt import DocumentPrompt
    from pipeline.inference.engine import Engine
    from pipeline.schema.job import TaskSpec

    loaded = SimpleNamespace(model=model, tokenizer=_NoTextTokenizer(), kind="text", name="whole-model")
    engine = Engine(loaded, cache_spec(cache, chunk))
    task = TaskSpec(name="t", prompt="x", max_tokens=tokens)
    suffix = [11, 12, 13, 14]
    mx.clear_cache()
    mx.reset_peak_memory()
    ttft = None
    if context <= ttft_max:
        ids = [(7 * i + 3) % 4000 + 100 for i in range(context)]

        def prompt_of(n: int) -> DocumentPrompt:
            return DocumentPrompt(prefix_ids=ids[:n], task_ids={"t": suffix}, page_offsets={1: 0},
                                  included_pages=[1], skipped_pages=[])

        first = TaskSpec(name="t", prompt="x", max_tokens=1)
        engine.run_task(engine.prefill(prompt_of(min(context, 2 * chunk))), first, suffix)  # warm-up
        engine.cache = None
        mx.clear_cache()
        mx.reset_peak_memory()  # the row's peak is the timed prefill's
        prompt = prompt_of(context)
        t0 = time.perf_counter()
        state = engine.prefill(prompt, reserve=len(suffix) + tokens)
        engine.run_task(state, first, suffix)
        ttft = time.perf_counter() - t0
    else:
        from pipeline.inference.engine import _make_cache

        engine.cache = _make_cache(model, engine.cache_spec)
        _fill(engine.cache, cfg, context, dtype)
        state = _state(engine, context)
    engine.settle(state)
    kv = engine.cache_nbytes()
    engine.run_task(state, TaskSpec(name="t", prompt="x", max_tokens=4), suffix)  # warm-up: compiles, first launches
    res = engine.run_task(state, task, suffix)
    decode = res.tokens["generated"] / res.timing["decode_s"]
    gen = _generate_step_tok_s(engine, tokens)
    row = {"context": context, "cache": cache, "fits": True, "decode_tok_s": round(decode, 3),
           "generate_step_tok_s": round(gen, 3), "ttft_s": None if ttft is None else round(ttft, 3),
           "kv_bytes": int(kv), "peak_bytes": int(mx.get_peak_memory())}
    engine.cache = None
    mx.clear_cache()
    return row


def bytes_per_token(model, cfg: dict, cache: str, dtype: mx.Dtype, n: int = 8192) -> float:
    """The cache's bytes per token, measured on a small synthetic fill (so a
    row that would not fit is skipped before it is tried)."""
    from pipeline.inference.engine import _make_cache

    caches = _make_cache(model, cache_spec(cache, 512))
    _fill(caches, cfg, n, dtype)
    for c in caches:
        if hasattr(c, "settle"):
            c.settle()
    mx.eval([c.state for c in caches])
    used = sum(getattr(c, "used_nbytes", None) or c.nbytes for c in caches)
    del caches
    mx.clear_cache()
    return used / n


def device_bytes() -> int:
    """The default device's memory (the host's RAM on CPU)."""
    import os

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    n = int(info.get("memory_size") or info.get("total_memory") or 0)
    return n or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weights_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--append", action="store_true",
                    help="add the rows to those already in --json (a long sweep split over several calls)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: tiny shape, float32, short contexts")
    ap.add_argument("--shape", default=None, help="8b (default), 1b or tiny")
    ap.add_argument("--contexts", default=None, help="comma-separated token counts")
    ap.add_argument("--caches", default=",".join(CACHES))
    ap.add_argument("--tokens", type=int, default=None, help="timed decode tokens (default 64; 8 with --tiny)")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk of the real prefills")
    ap.add_argument("--ttft-max", type=int, default=None,
                    help="largest context prefilled for real (default 131072; 512 with --tiny)")
    a = ap.parse_args(argv)
    shape = a.shape or ("tiny" if a.tiny else "8b")
    dtype = mx.float32 if a.tiny else mx.bfloat16
    contexts = [int(x) for x in a.contexts.split(",")] if a.contexts else list(TINY_CONTEXTS if a.tiny else CONTEXTS)
    caches = [c for c in a.caches.split(",") if c]
    unknown = [c for c in caches if not known_cache(c)]
    if unknown:
        ap.error(f"unknown caches {unknown}; choose from {', '.join(CACHES)} or turboquant-kKvV "
                 f"(TurboQuant ones with an optional {CONSTANT_MEAN})")
    tokens = a.tokens or (8 if a.tiny else 64)
    chunk = min(a.chunk, 256) if a.tiny else a.chunk
    ttft_max = a.ttft_max if a.ttft_max is not None else (512 if a.tiny else 131072)

    model, cfg = build_model(shape, dtype)
    wbytes = weights_bytes(model)
    budget = device_bytes() * HEADROOM
    rows = []
    small = min(8192, min(contexts))
    per_token = {}
    for c in caches:
        with key_centring(c):
            per_token[c] = bytes_per_token(model, cfg, c, dtype, small)
    for context in contexts:
        for cache in caches:
            if wbytes + per_token[cache] * context * 1.05 > budget:
                rows.append({"context": context, "cache": cache, "fits": False, "decode_tok_s": None,
                             "generate_step_tok_s": None, "ttft_s": None,
                             "kv_bytes": int(per_token[cache] * context), "peak_bytes": None})
                print(json.dumps(rows[-1]), flush=True)
                continue
            with key_centring(cache):
                row = measure_row(model, cfg, context, cache, tokens=tokens, chunk=chunk, ttft_max=ttft_max,
                                  dtype=dtype)
            per_token[cache] = row["kv_bytes"] / context  # the longest measured context is the best estimate
            rows.append(row)
            print(json.dumps(row), flush=True)
    max_context = {c: int((budget - wbytes) / per_token[c]) for c in per_token if per_token[c] > 0}
    result = {
        "rows": rows,
        "max_context": max_context,
        "meta": {"shape": shape, "dtype": str(dtype), "weights_bytes": wbytes, "device_bytes": device_bytes(),
                 "timed_tokens": tokens, "prefill_chunk": chunk, "mlx": mx.__version__,
                 "device": str(mx.default_device()), "machine": platform.machine()},
    }
    if a.json and a.append and a.json.exists():
        old = json.loads(a.json.read_text())
        done = {(r["context"], r["cache"]) for r in rows}
        result["rows"] = [r for r in old["rows"] if (r["context"], r["cache"]) not in done] + rows
        result["rows"].sort(key=lambda r: (r["context"], cache_order(r["cache"])))
        result["max_context"] = {**old.get("max_context", {}), **max_context}
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
