"""Why a fused decode step takes the output of the step TC8_COUNTER_RING
before it as an input: without that ordering, steps that share a counter set
run side by side and corrupt each other's results.

  python3 benchmarks/counter_ring_check.py

20 independent steps of one plan (one cache, 20 queries) are evaluated
together, three ways: as main does it (ring of counter sets + ordering
input), the ring without the ordering input, and one set without it.  It
prints each way's largest relative error against the reference path over
5 repeats.  NVIDIA GPUs only (the one-launch step is CUDA-only).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["TQ_DECODE_FUSED"] = "1"

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from turboquant import kernels  # noqa: E402
from turboquant.attention import turboquant_attention as reference  # noqa: E402
from turboquant.cache import TurboQuantKVCache  # noqa: E402


def rel(a: mx.array, b: mx.array) -> float:
    a, b = (np.asarray(x.astype(mx.float32), np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main() -> int:
    if kernels.backend() != "cuda":
        print("counter_ring_check: needs an NVIDIA GPU (MLX's CUDA build)", file=sys.stderr)
        return 2
    d, h_kv, g, steps = 128, 2, 4, 20
    mx.random.seed(0)
    cache = TurboQuantKVCache(kv_bits=3.5, window=128)
    cache.update_and_fetch(mx.random.normal((1, h_kv, 20000, d)) + 0.5, mx.random.normal((1, h_kv, 20000, d)))
    k = mx.random.normal((1, h_kv, 1, d)).astype(mx.float16)
    wk, wv = cache.update_and_fetch(k, k)
    qs = [mx.random.normal((1, h_kv * g, 1, d)).astype(mx.float16) for _ in range(steps)]
    os.environ["TQ_KERNELS"] = "reference"
    refs = [reference(q, wk, wv, cache, d**-0.5, None) for q in qs]
    mx.eval(refs)
    launch = kernels._StepPlan.launch
    for mode in ("ring + ordering input (main)", "ring, no ordering input", "one set, no ordering input"):
        def patched(self, *a, _mode=mode, **kw):
            if _mode != "ring + ordering input (main)":
                self.last = [mx.zeros((1,), mx.float16)] * kernels.TC8_COUNTER_RING
                if _mode.startswith("one set"):
                    self.slot = 0
            return launch(self, *a, **kw)
        kernels._StepPlan.launch = patched
        os.environ["TQ_KERNELS"] = "gpu"
        errs = []
        for _ in range(5):
            outs = [kernels.turboquant_attention(q, wk, wv, cache, d**-0.5, None) for q in qs]
            mx.eval(outs)  # one evaluation: independent launches may run side by side
            errs.append(max(rel(o, r) for o, r in zip(outs, refs)))
        print(f"{mode}: largest relative error over {steps} steps evaluated together, 5 repeats: "
              + " ".join(f"{e:.2e}" for e in errs))
    kernels._StepPlan.launch = launch
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
