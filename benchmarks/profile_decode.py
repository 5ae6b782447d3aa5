"""One 3.5-bit decode step at 512k tokens (``--tokens N`` for another
length, e.g. 32k), for Nsight Compute.

By default the one-launch step as a model runs it (``turboquant_attention``
with a 128-token fp16 window: ``tq_decode_tc8_fused``); ``--kernel`` profiles
the attention kernel alone on pre-rotated queries (``tq_decode_tc8``):

  ncu --clock-control none -k regex:tq_decode_tc8_ --launch-count 1 \\
      --section SchedulerStats --section WarpStateStats --section Occupancy \\
      --section SpeedOfLight python3 benchmarks/profile_decode.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_attention as g  # noqa: E402
import mlx.core as mx  # noqa: E402

n = g.parse_len(sys.argv[sys.argv.index("--tokens") + 1]) if "--tokens" in sys.argv else 512 * 1024
c = g.tq_cache(n, 3.5)
if "--kernel" in sys.argv:
    q_rot = mx.random.normal((1, g.HKV, g.HQ // g.HKV, g.D)) * g.SCALE
    f = g.tq_decode_fn(c, q_rot)
else:
    q = mx.random.normal((1, g.HQ, 1, g.D)).astype(mx.float16)
    step = g.whole_step(g.window_keys())

    def f():
        return step(q, c)
for _ in range(3):
    mx.eval(f())
mx.synchronize()
print("profiled")
