#!/usr/bin/env bash
# One GPU device call for benchmarks/bench_rollout_engine.py (issue #39, Deliver 5): the engine's decode step at
# 1 / 8 / 32 / 64 active slots after 32K, then a GRPO round of 64 episodes after 4K, 32K, 128K three ways (the
# engine, the one-at-a-time cached rollout, TRL's own loop), the cost model fitted to the decode steps.
#   usage: bash benchmarks/device_rollout_engine.sh [bench_rollout_engine.py args...]   (writes under $OUT)
# Carry .whl/ and, when an earlier call returned them, .tcache/ (its tcache.part.* files: compiled Triton kernels and
# autotune choices). The device has neither trl nor datasets: .whl/ holds the wheels benchmarks/device_long_rl.sh
# lists (trl 1.16.0, datasets, dill, multiprocess, transformers; the command to fetch them is in that script).
# Environment: ENGINE_TOTAL_S (470: the whole call, s; the bench's deadline is what is left of it after the set-up,
# less 20 s, and less 45 s for packing the Triton cache unless ENGINE_PACK=0), ENGINE_ONLY (the parts, default
# steps,round: the decode steps first, the cheapest and most telling).
# Files back: rollout_engine.json and rollout_engine.md (rewritten after every measurement), rollout_engine.log
# (every line the bench printed, with tracebacks) and the Triton cache parts (fewer when more would pass the 8 files
# a call returns).
set -u
source "$(dirname "$0")/tcache.sh"  # the Triton cache between calls; device_start / _wheels / _bench / _finish
device_start "${ENGINE_TOTAL_S:-470}" "${ENGINE_PACK:-1}" rollout_engine.log
export TRL_EXPERIMENTAL_SILENCE=1
device_wheels .whl/*.whl || { echo "wheel install failed" >> "$LOG"; tail -n 20 "$LOG"; exit 1; }
export PYTHONPATH=$SCRATCH/site:$PWD
python3 -c "import trl, datasets, transformers, accelerate; print('trl', trl.__version__, 'transformers', \
transformers.__version__, 'accelerate', accelerate.__version__)" >> "$LOG" 2>&1 \
    || { echo "trl / datasets / accelerate missing from .whl/ or the image" >> "$LOG"; tail -n 20 "$LOG"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv >> "$LOG" 2>&1

device_bench benchmarks/bench_rollout_engine.py --only "${ENGINE_ONLY:-steps,round}" "$@"
device_finish "${ENGINE_PACK:-1}"
if [ -f "$OUT/rollout_engine.md" ]; then head -c 9000 "$OUT/rollout_engine.md"; fi
