"""What an evaluation of N chained decode calls costs besides the kernels.

  python3 benchmarks/submit_cost.py --tokens 512k,32k [--batches 1,2,4,8,32,128]

For fp16 SDPA and the TurboQuant step, N dependent calls (each call's
query is the previous call's output, as a model's layers) are built, then
evaluated; per call it prints the time ``mx.async_eval`` takes to return
(MLX's ``eval_gpu`` of every node, recording CUDA graph nodes and launching
the graphs: the host's submission) and the time to the evaluation's end.
The submission is where a chain's first kernel waits: MLX launches a CUDA
graph once it holds ``MLX_MAX_OPS_PER_BUFFER`` nodes or inputs of
``MLX_MAX_MB_PER_BUFFER`` (MLX counts elements there), or at the end of the
evaluation.  Run it under different settings of those (and of
``MLX_USE_CUDA_GRAPHS``) in separate processes: MLX reads them once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu_attention as g  # noqa: E402
import mlx.core as mx  # noqa: E402


def chain_costs(step, q0, caches, batch: int, repeats: int = 7) -> tuple[float, float]:
    """(submission, whole evaluation) seconds per call, medians; the calls
    cycle through ``caches`` (copies, so that no call finds its cache in L2)."""
    mx.eval(g.chained(step, q0, caches, batch))
    mx.synchronize()
    subs, tots = [], []
    for _ in range(repeats):
        out = g.chained(step, q0, caches, batch)
        t0 = time.perf_counter()
        mx.async_eval(out)
        t1 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        t2 = time.perf_counter()
        subs.append((t1 - t0) / batch)
        tots.append((t2 - t0) / batch)
        del out
    return g.median(subs), g.median(tots)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="512k,32k")
    ap.add_argument("--batches", default="1,2,4,8,32,128")
    ap.add_argument("--generation", action="store_true", help="also the generation loop (32 calls per token)")
    args = ap.parse_args()
    env = " ".join(f"{k}={os.environ[k]}" for k in ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER",
                                                    "MLX_MAX_MB_PER_BUFFER") if k in os.environ)
    print(f"== submission cost, mlx {mx.__version__}, {env or 'MLX defaults'}")
    batches = [int(b) for b in args.batches.split(",")]
    q = mx.random.normal((1, g.HQ, 1, g.D)).astype(mx.float16)
    wk = g.window_keys()
    for n in (g.parse_len(s) for s in args.tokens.split(",")):
        k, v = g.fp16_cache(n)
        c0 = g.tq_cache(n, 3.5)
        rows = {"fp16 sdpa": (g.fp16_step, [(k, v)] + [g.fp16_cache(n) for _ in range(
                    min(8, g.copies_for(k.nbytes + v.nbytes)) - 1)]),
                "tq 3.5 whole step": (g.whole_step(wk), [c0] + [g.tq_cache(n, 3.5, seed=i + 1) for i in range(
                    min(8, g.copies_for(c0.nbytes)) - 1)])}
        del k, v, c0
        print(f"  {n} tokens: per call, us: submit / total (x = fp16 total / tq total)")
        for b in batches:
            r = {name: chain_costs(f, q, c, b) for name, (f, c) in rows.items()}
            (s16, t16), (stq, ttq) = r["fp16 sdpa"], r["tq 3.5 whole step"]
            print(f"    batch {b:>3}: fp16 {s16 * 1e6:7.1f} / {t16 * 1e6:7.1f}   tq {stq * 1e6:7.1f} / {ttq * 1e6:7.1f}"
                  f"   {t16 / ttq:.2f}x")
        del rows
        mx.clear_cache()
    if args.generation:
        g.bench_generation([g.parse_len(s) for s in args.tokens.split(",")], {})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
