"""Peak process memory vs. KV bytes: does the TurboQuant saving reach the process?

    python -m benchmarks.memory [--tokens 8192] [--layers 8] [--chunk 512]
        [--decode 32] [--kv-bits 3.5] [--window 128] [--json]

A compressed cache only matters if the *process* shrinks with it.  mlx-vlm's
own numbers (Qwen3.5-4B, 128k tokens: KV 4.1 -> 0.97 GB but peak 18.3 ->
17.3 GB) show how prefill activations, full-precision shadow copies and
whole-cache temporaries can eat the saving.  This benchmark runs one long
document through the pipeline's own ``Engine`` (chunked backbone-only
prefill, logits for the last position only, then one task of ``--decode``
greedy tokens) once with the full-precision cache and once with the
TurboQuant cache, each in a fresh subprocess (peak memory and max RSS are
per process), and reports

    ratio = (peak_full - peak_tq) / (kv_full - kv_tq)

for ``mx.get_peak_memory()`` and for the OS's max RSS.  The goal is >= 0.8.

Model: ``KV_HEAVY_LLAMA``, a built-in mlx-lm llama config with random
seeded weights, chosen so the cache dominates the weights the way it does
for a real model at long context: no GQA (8 KV heads x head_dim 128, i.e.
8 KiB of float32 keys+values per token and layer) on a small hidden size
(256), so 8 layers hold ~46 MB of weights and 8k tokens ~0.55 GB of cache.

CPU caveat: the model runs in float32 (MLX's CPU float16 matmul is ~40x
slower), so the full-precision baseline cache is float32.  Besides the
measured ratio we report the ratio for an fp16 baseline derived from the
same measurements: an estimate (only the cache's own bytes halve) and a
lower bound (every byte the full-precision run allocated beyond the loaded
model halves, while the TurboQuant run keeps its float32 working memory).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import turboquant  # noqa: F401  (fast CPU BLAS before mlx.core)
import mlx.core as mx

#: The built-in memory-benchmark model (mlx_lm.models.llama.ModelArgs).
KV_HEAVY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "vocab_size": 1024,
    "tie_word_embeddings": True,
}

SCHEMES = ("fp16", "turboquant")


def build_model(model_args: dict[str, Any], seed: int = 0) -> Any:
    """An mlx-lm llama with seeded random float32 weights, evaluated."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(**model_args))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if platform.system() == "Darwin" else rss * 1024)  # Linux reports KiB


class _NoTextTokenizer:
    """The engine wants ``eos_token_ids`` and ``decode``; random weights need neither."""

    eos_token_ids: list[int] = []

    def decode(self, ids: Sequence[int]) -> str:
        return ""


def measure(scheme: str, *, tokens: int, chunk: int = 512, decode: int = 32, kv_bits: float = 3.5,
            window: int = 128, model_args: dict[str, Any] | None = None, seed: int = 0) -> dict[str, Any]:
    """Run one document + one decode task in THIS process; return its memory numbers.

    Call it in a fresh process: ``peak`` and ``maxrss`` are process-wide
    high-water marks (``main`` does that with a subprocess per scheme).
    """
    from mlx.utils import tree_flatten

    from pipeline.inference.engine import Engine
    from pipeline.inference.prompt import DocumentPrompt
    from pipeline.models.load import LoadedModel
    from pipeline.schema.job import CacheSpec

    if scheme not in SCHEMES:
        raise ValueError(f"benchmarks.memory: unknown scheme {scheme!r}; choose one of {SCHEMES}")
    args = dict(model_args or KV_HEAVY_LLAMA)
    model = build_model(args, seed)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    loaded_active, loaded_rss = mx.get_active_memory(), _maxrss_bytes()

    spec = CacheSpec(kv_quant_scheme=scheme, kv_bits=kv_bits if scheme == "turboquant" else 3.5,
                     window=window, prefill_chunk=chunk)
    engine = Engine(
        LoadedModel(kind="text", model=model, processor=None, tokenizer=_NoTextTokenizer(),
                    name="kv-heavy-llama", config=args),
        spec,
    )
    rng = mx.random.key(seed + 1)
    ids = mx.random.randint(0, args["vocab_size"], (tokens,), key=rng).tolist()
    task_ids = ids[:4]
    prompt = DocumentPrompt(prefix_ids=ids, task_ids={"t": task_ids}, page_offsets={},
                            included_pages=[], skipped_pages=[])
    task = SimpleNamespace(name="t", temperature=0.0, max_tokens=decode)

    def kv_allocated() -> int:  # bytes the cache arrays hold (capacity, not just used slots)
        return int(sum(c.nbytes for c in engine.cache))

    state = engine.prefill(prompt, reserve=len(task_ids) + decode)
    kv_prefill, kv_decode = kv_allocated(), [0]

    def on_token(_: int) -> None:
        kv_decode[0] = max(kv_decode[0], kv_allocated())

    result = engine.run_task(state, task, task_ids, on_token=on_token)
    return {
        "scheme": scheme,
        "kv_bits": kv_bits if scheme == "turboquant" else None,
        "window": window if scheme == "turboquant" else None,
        "tokens": tokens,
        "chunk": chunk,
        "generated": len(result.token_ids),
        "weights_bytes": weights,
        "loaded_active_bytes": loaded_active,
        "loaded_maxrss_bytes": loaded_rss,
        "kv_bytes_prefill": kv_prefill,
        "kv_bytes": kv_decode[0],  # largest during decode (before the engine's rewind)
        "peak_bytes": mx.get_peak_memory(),
        "maxrss_bytes": _maxrss_bytes(),
        "prefill_s": result.timing["prefill_s"],
        "decode_s": result.timing["decode_s"],
    }


def measure_in_subprocess(scheme: str, **options: Any) -> dict[str, Any]:
    """``measure`` in a fresh Python process (its own peak memory and max RSS)."""
    cmd = [sys.executable, "-m", "benchmarks.memory", "--worker", scheme,
           "--worker-options", json.dumps(options)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks.memory: worker for {scheme!r} failed "
                           f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(full: dict[str, Any], tq: dict[str, Any]) -> dict[str, float]:
    """Peak saving / KV saving, measured, and derived for an fp16 baseline."""
    kv_saving = full["kv_bytes"] - tq["kv_bytes"]
    if kv_saving <= 0:
        raise ValueError(f"benchmarks.memory: no KV saving to compare (full {full['kv_bytes']} B, "
                         f"TurboQuant {tq['kv_bytes']} B)")
    out = {
        "kv_saving_bytes": kv_saving,
        "ratio_peak": (full["peak_bytes"] - tq["peak_bytes"]) / kv_saving,
        "ratio_maxrss": (full["maxrss_bytes"] - tq["maxrss_bytes"]) / kv_saving,
        "kv_compression": full["kv_bytes"] / tq["kv_bytes"],
    }
    # fp16 baseline, derived: its cache holds half the float32 cache's bytes.
    kv16 = full["kv_bytes"] / 2
    kv16_saving = kv16 - tq["kv_bytes"]
    if kv16_saving > 0:
        out["fp16_kv_saving_bytes"] = kv16_saving
        # estimate: only the cache halves
        out["fp16_ratio_peak_estimate"] = (full["peak_bytes"] - kv16 - tq["peak_bytes"]) / kv16_saving
        # lower bound: everything the full run allocated beyond the loaded model halves
        base = full["loaded_active_bytes"]
        peak16 = base + (full["peak_bytes"] - base) / 2
        out["fp16_ratio_peak_lower_bound"] = (peak16 - tq["peak_bytes"]) / kv16_saving
    return out


def _mb(b: float) -> str:
    return f"{b / 1e6:,.1f} MB"


def format_report(full: dict[str, Any], tq: dict[str, Any], cmp: dict[str, float]) -> str:
    rows = [("full precision (float32 on CPU)", full), (f"TurboQuant {tq['kv_bits']:g} bits, "
                                                       f"window {tq['window']}", tq)]
    lines = ["| cache | weights | KV after prefill | KV after decode | mx peak | max RSS | "
             "peak - weights - KV | prefill | decode |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        lines.append(
            f"| {name} | {_mb(r['weights_bytes'])} | {_mb(r['kv_bytes_prefill'])} | {_mb(r['kv_bytes'])} | "
            f"{_mb(r['peak_bytes'])} | {_mb(r['maxrss_bytes'])} | "
            f"{_mb(r['peak_bytes'] - r['weights_bytes'] - r['kv_bytes'])} | "
            f"{r['prefill_s']:.1f} s | {r['decode_s']:.1f} s |")
    lines += [
        "",
        f"KV saving {_mb(cmp['kv_saving_bytes'])} ({cmp['kv_compression']:.2f}x smaller); "
        f"peak saving {_mb(full['peak_bytes'] - tq['peak_bytes'])} (mx), "
        f"{_mb(full['maxrss_bytes'] - tq['maxrss_bytes'])} (max RSS)",
        f"ratio peak saving / KV saving: {cmp['ratio_peak']:.3f} (mx.get_peak_memory), "
        f"{cmp['ratio_maxrss']:.3f} (max RSS)   [goal >= 0.8]",
    ]
    if "fp16_ratio_peak_estimate" in cmp:
        lines.append(
            f"fp16 baseline (derived, KV {_mb(full['kv_bytes'] / 2)}): ratio {cmp['fp16_ratio_peak_estimate']:.3f} "
            f"estimate, {cmp['fp16_ratio_peak_lower_bound']:.3f} lower bound")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="document length in tokens")
    p.add_argument("--layers", type=int, default=KV_HEAVY_LLAMA["num_hidden_layers"])
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (the pipeline's default)")
    p.add_argument("--decode", type=int, default=32, help="greedy tokens after the document")
    p.add_argument("--kv-bits", type=float, default=3.5)
    p.add_argument("--window", type=int, default=128, help="TurboQuant exact window")
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    p.add_argument("--worker", choices=SCHEMES, help=argparse.SUPPRESS)
    p.add_argument("--worker-options", default="{}", help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.worker:
        print(json.dumps(measure(a.worker, **json.loads(a.worker_options))))
        return 0

    model_args = dict(KV_HEAVY_LLAMA, num_hidden_layers=a.layers)
    options = dict(tokens=a.tokens, chunk=a.chunk, decode=a.decode, kv_bits=a.kv_bits,
                   window=a.window, model_args=model_args)
    print(f"model: kv-heavy llama {json.dumps(model_args)}", flush=True)
    print(f"document: {a.tokens} random tokens, prefill chunk {a.chunk}, then {a.decode} decode steps; "
          f"one subprocess per cache", flush=True)
    t0 = time.perf_counter()
    full = measure_in_subprocess("fp16", **options)
    tq = measure_in_subprocess("turboquant", **options)
    cmp = compare(full, tq)
    print(format_report(full, tq, cmp))
    print(f"total {time.perf_counter() - t0:.0f} s on {platform.machine()} CPU")
    if a.json:
        print(json.dumps({"model_args": model_args, "full": full, "turboquant": tq, **cmp}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
