"""One 3.5-bit decode-attention call at 512k tokens, for Nsight Compute:

  ncu --clock-control none -k regex:tq_decode_tc8_[0-9a-f] --launch-count 1 \\
      --section SchedulerStats --section WarpStateStats --section Occupancy \\
      --section SpeedOfLight python3 benchmarks/profile_decode.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_attention as g  # noqa: E402
import mlx.core as mx  # noqa: E402

c = g.tq_cache(512 * 1024, 3.5)
q_rot = mx.random.normal((1, g.HKV, g.HQ // g.HKV, g.D)) * g.SCALE
f = g.tq_decode_fn(c, q_rot)
for _ in range(3):
    mx.eval(f())
mx.synchronize()
print("profiled")
