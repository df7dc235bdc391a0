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
source "$(dirname "$0")/tcache.sh"  # tcache_restore / tcache_pack: the Triton cache between calls
T0=$(date +%s)
END=$(( T0 + ${RL_TOTAL_S:-570} - 45 ))  # the last 45 s pack the Triton cache
left() { echo $(( END - $(date +%s) )); }
SCRATCH=$(mktemp -d)
OUT=${OUT:-benchmarks/results}
LOG=$OUT/long_rl.log
mkdir -p "$OUT" "$SCRATCH/tcache"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 HF_HOME=$SCRATCH/hf TRL_EXPERIMENTAL_SILENCE=1
export TRITON_CACHE_DIR=$SCRATCH/tcache TRITON_CACHE_AUTOTUNING=1
if tcache_restore "$TRITON_CACHE_DIR"; then echo "Triton cache restored" >> "$LOG"; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SCRATCH/site" \
    .whl/*.whl >> "$LOG" 2>&1 || { echo "wheel install failed" >> "$LOG"; exit 1; }
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

budget=$(left)
echo "== bench, budget $budget s" >> "$LOG"
timeout "$budget" python3 benchmarks/bench_long_rl.py --out "$OUT" --budget-s $(( budget - 20 )) \
    --only "${RL_ONLY:-turns,update,trajectory}" "$@" >> "$LOG" 2>&1
echo "bench exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"

rm -f "$OUT"/*.tmp
tcache_pack "$TRITON_CACHE_DIR" "$OUT"
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
    rm -f "$OUT"/tcache.part.*
    echo "more than the 8 files a call returns: the Triton cache is not returned" >> "$LOG"
fi
echo "done at $(( $(date +%s) - T0 )) s; Triton cache parts: $(ls "$OUT"/tcache.part.* 2>/dev/null | wc -l)" >> "$LOG"
tail -n 12 "$LOG"
head -c 9000 "$OUT/long_rl.md"
