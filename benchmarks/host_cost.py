"""Where the host time of one decode step goes (no evaluation, GPU needed).

  python benchmarks/host_cost.py [--tokens 32k]

Builds (without evaluating) one decode step many times and prints the
microseconds per call of each part: fp16 SDPA's graph build for scale, the
split counters (a fill node vs host-built zeros), the plan lookup, the
Python of the launch, MLX's ``cuda_kernel`` call with prebuilt arguments
(with the kernel source as shipped and with its comments stripped), and the
whole ``turboquant_attention`` call; then a profile of the whole call.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import turboquant  # noqa: E402,F401
import mlx.core as mx  # noqa: E402

import gpu_attention as ga  # noqa: E402
from turboquant import kernels  # noqa: E402


def per_call(fn, n: int = 3000) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    src = re.sub(r"//[^\n]*", "", src)
    return re.sub(r"\n\s*\n+", "\n", src)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32k")
    args = ap.parse_args()
    n = ga.parse_len(args.tokens)
    q = mx.random.normal((1, ga.HQ, 1, ga.D)).astype(mx.float16)
    wk = mx.random.normal((1, ga.HKV, 128, ga.D)).astype(mx.float16)
    k, v = ga.fp16_cache(n)
    c = ga.tq_cache(n, 3.5)
    step = lambda: kernels.turboquant_attention(q, wk, wk, c, ga.SCALE, None)  # noqa: E731
    ref = step()
    mx.eval(ref)
    plan = kernels._step_plan(q, wk, wk, c, ga.SCALE)
    captured = {}
    kern, template = plan.kernel

    def capture(**kw):
        captured.update(kw)
        return kern(**kw)

    plan.kernel = (capture, template)
    step()
    plan.kernel = (lambda **kw: (None, None), template)
    python_launch = per_call(lambda: plan.launch(q, wk, wk, c, n))
    plan.kernel = (kern, template)
    rows = {
        "fp16 sdpa call": per_call(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=ga.SCALE)),
        "mx.zeros counters (fill node)": per_call(lambda: mx.zeros((8,), mx.uint32)),
        "host-built zero counters": per_call(lambda: mx.array([0] * 8, dtype=mx.uint32)),
        "plan lookup": per_call(lambda: kernels._step_plan(q, wk, wk, c, ga.SCALE)),
        "launch Python, kernel call stubbed": python_launch,
        "cuda_kernel call, prebuilt args": per_call(lambda: kern(**captured)),
    }
    header, body = kernels.kernel_source("tq_decode_tc8_fused", "cuda")
    header += plan_prelude(plan)
    small = mx.fast.cuda_kernel(name="tq_host_cost_stripped", input_names=kernels._SIGNATURES["tq_decode_tc8_fused"][0],
                                output_names=kernels._SIGNATURES["tq_decode_tc8_fused"][1],
                                source=strip_comments(body), header=strip_comments(header))
    print(f"source: {len(header) + len(body)} chars as shipped, "
          f"{len(strip_comments(header)) + len(strip_comments(body))} without comments")
    out_small = small(**captured)[1]
    mx.eval(out_small)
    print(f"stripped kernel max |diff| vs shipped: {mx.abs(out_small.astype(mx.float32) - ref.astype(mx.float32)).max().item():.3g}")
    rows["cuda_kernel call, comments stripped"] = per_call(lambda: small(**captured))
    rows["whole step (turboquant_attention)"] = per_call(step)
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


def plan_prelude(plan) -> str:
    cfg = kernels._tc8_config(*plan.dims[:3], 1, *plan.dims[3:], True, plan.env)
    return cfg["PRELUDE"]


if __name__ == "__main__":
    raise SystemExit(main())
