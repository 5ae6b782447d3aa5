"""Where the host time of one decode step goes (no evaluation, GPU needed).

  python benchmarks/host_cost.py [--tokens 32k]

Builds (without evaluating) one decode step many times and prints the
microseconds per call of each part: fp16 SDPA's graph build for scale, the
split counters (a fill node vs host-built zeros), the plan lookup, the
Python of the launch, MLX's ``cuda_kernel`` call with prebuilt arguments
and the compiled launcher's replay, and the whole ``turboquant_attention``
call with each; then a profile of the whole (compiled) call.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import turboquant  # noqa: E402,F401
import mlx.core as mx  # noqa: E402

import gpu_attention as ga  # noqa: E402
from turboquant import kernels  # noqa: E402


def per_call(fn, n: int = 3000, warm: int = 200, repeats: int = 5) -> float:
    """Best of ``repeats`` timings of ``n`` calls (after ``warm`` calls),
    microseconds per call."""
    for _ in range(warm):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32k")
    args = ap.parse_args()
    n = ga.parse_len(args.tokens)
    q = mx.random.normal((1, ga.HQ, 1, ga.D)).astype(mx.float16)
    wk = ga.window_keys()
    k, v = ga.fp16_cache(n)
    c = ga.tq_cache(n, 3.5)
    whole = ga.whole_step(wk)
    step = lambda: whole(q, c)  # noqa: E731
    os.environ["TQ_DECODE_COMPILE"] = "1"
    ref = step()
    mx.eval(ref)
    compiled_step = per_call(step)
    os.environ["TQ_DECODE_COMPILE"] = "0"  # direct launches: capture one call's arguments
    mx.eval(step())
    plan = kernels._step_plan(q, wk, wk, c, ga.SCALE)
    captured = {}
    kern = plan.kernel

    def capture(**kw):
        captured.update(kw)
        return kern(**kw)

    def reset(k):
        plan.kernel = k
        plan.launchers.clear()
        plan.per_n.clear()

    reset(capture)
    step()
    reset(lambda **kw: (None, None))
    python_launch = per_call(lambda: plan.launch(q, wk, wk, c, n))
    reset(kern)
    direct_step = per_call(step)
    os.environ["TQ_DECODE_COMPILE"] = "1"
    cplan = kernels._step_plan(q, wk, wk, c, ga.SCALE)
    head, layout = next(iter(cplan.per_n.values()))
    launcher = cplan.launchers[(layout[0], wk.shape[2])]
    args = captured["inputs"]
    largs = (args[0], args[1], args[2], args[3], args[4], args[7], args[8], args[9], args[12], args[13])
    rows = {
        "fp16 sdpa call": per_call(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=ga.SCALE)),
        "mx.zeros counters (fill node)": per_call(lambda: mx.zeros((8,), mx.uint32)),
        "host-built zero counters": per_call(lambda: mx.array([0] * 8, dtype=mx.uint32)),
        "plan lookup": per_call(lambda: kernels._step_plan(q, wk, wk, c, ga.SCALE)),
        "launch Python, kernel call stubbed": python_launch,
        "cuda_kernel call, prebuilt args": per_call(lambda: kern(**captured)),
        "compiled launcher call": per_call(lambda: launcher(*largs)),
    }
    header, body = kernels.kernel_source("tq_decode_tc8_fused", "cuda")
    print(f"kernel source: {len(header) + len(body)} chars in metal/, "
          f"{len(kernels.compact_source(header)) + len(kernels.compact_source(body))} as handed to MLX")
    rows["whole step, direct launch (default)"] = direct_step
    rows["whole step, TQ_DECODE_COMPILE=1"] = compiled_step
    print(f"\n== host time per call, {n} tokens, no evaluation (us)")
    for name, t in rows.items():
        print(f"  {name:<40} {t:7.2f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3000):
        step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
