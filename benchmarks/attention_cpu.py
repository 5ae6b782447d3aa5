"""Reference-path TurboQuant attention vs MLX SDPA on this CPU.

    python -m benchmarks.attention_cpu [--contexts 4096,16384,32768] [--reps 7]

Decode (one query token, 32 query heads / 8 KV heads / d=128): each rep
times every variant back to back, so CPU contention from other processes
hits all of them alike; we report the median time and the median of the
per-rep ratios to fp16 SDPA (MLX's CPU float16 matmul has no BLAS path, so
the float32 SDPA column is printed too).  Peak memory is MLX's peak minus
what was allocated before the call: attention's own temporaries.
"""

from __future__ import annotations

import argparse
import time

import turboquant  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from turboquant.attention import turboquant_attention
from turboquant.cache import TurboQuantKVCache

H_KV, H_Q, D = 8, 32, 128
WIDTHS = (2.5, 3.5, 4)


def _once(f) -> float:
    t = time.perf_counter()
    mx.eval(f())
    return time.perf_counter() - t


def _peak(f) -> int:
    mx.eval(f())
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(f())
    return mx.get_peak_memory() - base


def _filled(bits: float, k: mx.array, v: mx.array) -> tuple:
    c = TurboQuantKVCache(bits, window=128)
    for a in range(0, k.shape[2], 4096):
        c.update_and_fetch(k[:, :, a : a + 4096], v[:, :, a : a + 4096])
        mx.eval(c.state)
    wk, wv = c.update_and_fetch(k[:, :, :1], v[:, :, :1])
    mx.eval(c.state)
    return c, wk, wv


def run(n: int, reps: int) -> str:
    mx.random.seed(0)
    k, v = mx.random.normal((1, H_KV, n, D)), mx.random.normal((1, H_KV, n, D))
    q = mx.random.normal((1, H_Q, 1, D))
    k16, v16, q16 = k.astype(mx.float16), v.astype(mx.float16), q.astype(mx.float16)
    fns = {
        "fp16-SDPA": lambda: mx.fast.scaled_dot_product_attention(q16, k16, v16, scale=D**-0.5),
        "fp32-SDPA": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5),
    }
    for bits in WIDTHS:
        c, wk, wv = _filled(bits, k, v)
        fns[f"TQ{bits}"] = lambda c=c, wk=wk, wv=wv: turboquant_attention(q, wk, wv, c, D**-0.5, None)
    mx.eval(k16, v16, q16)
    peaks = {name: _peak(f) for name, f in fns.items() if name.startswith("TQ")}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            times[name].append(_once(f))

    def med(xs):
        return sorted(xs)[len(xs) // 2]

    parts = [f"N={n:6d}"]
    for name in fns:
        ratio = med([t / r for t, r in zip(times[name], times["fp16-SDPA"])])
        extra = f", peak +{peaks[name] / 1e6:.0f} MB" if name in peaks else ""
        parts.append(f"{name} {med(times[name]) * 1e3:7.1f} ms ({ratio:.2f}x fp16{extra})")
    return " | ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    for n in (int(x) for x in args.contexts.split(",")):
        print(run(n, args.reps), flush=True)


if __name__ == "__main__":
    main()
