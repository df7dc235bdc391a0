#!/usr/bin/env bash
# One H200 device call for benchmarks/bench_long_rl.py (issue #16): rollout turns on a kept cache against TRL's
# re-prefilling loop (4K ... 1M), one multi-turn trajectory, one GRPO optimizer step over >= 1M tokens of
# trajectories and TRL's defaults until they run out of memory.
#   usage: bash benchmarks/device_long_rl.sh [bench_long_rl.py args...]   (writes under $OUT)
# Carry .whl/ and, when an earlier call returned them, .tcache/ (its tcache.part.* files). The device has neither
# trl nor datasets: .whl/ must hold trl 1.16.0, datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19 besides
# transformers 5.24.0 (and fla_core 0.6.0 for the other device scripts). Fetch them here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       transformers==5.24.0 fla-core==0.6.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# (.whl/ is ignored by git: the repo does not ship them.)
# Environment: RL_TOTAL_S (570: the whole call, s), RL_ONLY (the bench parts, default turns,update,trajectory),
# RL_PYTEST_TESTS (GPU tests to run first with KDAMOE_TEST_ON_GPU=1, default none), RL_PYTEST_S (150).
# Files back: long_rl.json, long_rl.md, long_rl.log (every step's output), and at most four 15 MB parts of the
# Triton cache (fewer when more would pass the 8 files a call returns).
set -u
source "$(dirname "$0")/tcache.sh"  # the Triton cache between calls; device_start / _wheels / _bench / _finish
device_start "${RL_TOTAL_S:-570}" 1 long_rl.log  # the last 45 s pack the Triton cache
export TRL_EXPERIMENTAL_SILENCE=1
device_wheels .whl/*.whl || { echo "wheel install failed" >> "$LOG"; exit 1; }
export PYTHONPATH=$SCRATCH/site:$PWD
python3 -c "import trl, datasets, transformers; print('trl', trl.__version__, 'datasets', datasets.__version__, \
'transformers', transformers.__version__)" >> "$LOG" 2>&1 || { echo "trl / datasets missing from .whl/" >> "$LOG"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv >> "$LOG" 2>&1

if [ -n "${RL_PYTEST_TESTS:-}" ]; then
    echo "== GPU tests, limit ${RL_PYTEST_S:-150} s: $RL_PYTEST_TESTS" >> "$LOG"
    KDAMOE_TEST_ON_GPU=1 timeout "${RL_PYTEST_S:-150}" python3 -m pytest -q -p no:cacheprovider $RL_PYTEST_TESTS \
        >> "$LOG" 2>&1
    echo "GPU tests exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
fi

device_bench benchmarks/bench_long_rl.py --only "${RL_ONLY:-turns,update,trajectory}" "$@"
device_finish 1
head -c 9000 "$OUT/long_rl.md"
