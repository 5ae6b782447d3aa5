#!/usr/bin/env bash
# One device call on the lent H200: install MLX's CUDA build (halves from
# ../shared/tools/mlx-cuda-wheels.sh), run the GPU kernel tests, then the
# benchmark.  Logs go to $OUT.  Each step continues after a failure so the
# benchmark runs even if a test fails.
#   call 1 (carry .whl/a):  mkdir -p /root/stash && cp .whl/a/* /root/stash/
#   call 2 (carry .whl/b):  bash benchmarks/gpu_session.sh [all|tests|bench|tb|profile|timeline]  (tb = tests + bench)
# Environment: PYTEST_K (pytest -k filter), TEST_TIMEOUT / BENCH_TIMEOUT
# (seconds, default 240 / 300), BENCH_ARGS (extra gpu_attention.py flags),
# NCU_VARIANTS / NCU_ARGS / NCU_TIMEOUT (profile: see below), TL_VARIANTS /
# TL_ARGS (timeline: benchmarks/tg_timeline.py once per ';'-separated
# environment setting, e.g. "TQ_TC8_DYN=1;TQ_TC8_DYN=0").
set -x
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
what="${1:-all}"
if ! python3 -c 'import sys; sys.path.insert(0, "/tmp/site"); import mlx.core' 2>/dev/null; then
  test -f /root/stash/cuda.part.aa || { echo 'machine went cold: redo call 1'; exit 3; }
  cat /root/stash/cuda.part.aa .whl/b/cuda.part.ab > "/tmp/$(cat .whl/b/NAME)"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /root/stash/mlx-*.whl "/tmp/$(cat .whl/b/NAME)" .whl/b/*.whl || exit 4
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TQ_OPENBLAS=off
export LD_LIBRARY_PATH=$(ls -d /opt/torch/.venv/lib/python3.12/site-packages/nvidia/*/lib | tr '\n' ':')
export MLX_PTX_CACHE_DIR=/tmp/mlx-ptx
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c 'import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.cuda.is_available())' 2>&1 | tee -a "$OUT/gpu.txt"
if [ "$what" = all ] || [ "$what" = tests ] || [ "$what" = tb ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu ${PYTEST_K:+-k "$PYTEST_K"} tests/test_kernels.py 2>&1 \
    | tee "$OUT/tests.log" | tail -60
  # a timed-out run leaves its xdist workers (execnet children) running on
  # the GPU and the host CPU; they would skew every figure that follows
  pkill -f pytest 2>/dev/null; pkill -f 'sys.stdin.readline' 2>/dev/null; sleep 2
fi
if [ "$what" = all ] || [ "$what" = bench ] || [ "$what" = tb ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/gpu_attention.py --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log"
fi
if [ "$what" = all ] || [ "$what" = profile ]; then
  # NCU_VARIANTS: ';'-separated environment settings, one profile each
  # (e.g. "TQ_TC8_BLOCKS=264;TQ_TC8_BLOCKS=528"); the stall reasons come
  # per issued instruction (smsp__average_warps_issue_stalled_*)
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  IFS=';' read -r -a variants <<< "${NCU_VARIANTS:-TQ_TC8_BLOCKS=264}"
  i=0
  for v in "${variants[@]}"; do
    i=$((i + 1))
    echo "== ncu variant $i: $v" | tee -a "$OUT/ncu.txt"
    env $v timeout "${NCU_TIMEOUT:-120}" $NCU --clock-control none -k regex:tq_decode_tc8_ --launch-count 1 \
      --section SchedulerStats --section WarpStateStats --section Occupancy --section SpeedOfLight \
      --section LaunchStats --section InstructionStats \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 benchmarks/profile_decode.py $NCU_ARGS > "$OUT/ncu_$i.txt" 2>&1
    grep -E "Duration|Registers Per|Grid Size|Achieved Active|Issued Warp|Eligible Warps|Cycles Per Issued|DRAM Through|L1/TEX Cache|Executed Instructions  |stalled" "$OUT/ncu_$i.txt" \
      | grep -v -E " 0(\.0+)?$" | tee -a "$OUT/ncu.txt"
  done
fi
if [ "$what" = timeline ]; then
  IFS=';' read -r -a variants <<< "${TL_VARIANTS:-TQ_TC8_DYN=1}"
  i=0
  for v in "${variants[@]}"; do
    i=$((i + 1))
    echo "== timeline variant $i: $v" | tee -a "$OUT/timeline.txt"
    env $v timeout "${TL_TIMEOUT:-120}" python3 benchmarks/tg_timeline.py --save "$OUT/timeline_$i.npy" \
      ${TL_ARGS:---tokens 512k --chain 8 --repeats 1} 2>&1 | tee -a "$OUT/timeline.txt"
  done
fi
echo "session done"
