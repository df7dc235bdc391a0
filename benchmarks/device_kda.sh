#!/usr/bin/env bash
# One H200 device call for the KDA kernels: bench (bf16 errors + timings side by side with fla), then the GPU
# pytest. Needs the fla_core 0.6.0 wheel in .whl/ (carried; the device cannot reach a registry).
#   usage: bash benchmarks/device_kda.sh [bench_kda.py args...]   (writes under $OUT)
# The Triton cache (compiled kernels and, with TRITON_CACHE_AUTOTUNING=1, autotune choices) lives in a
# scratch directory; if .tcache/ holds the parts of a previous call's cache it is restored first, and the
# cache is written back to $OUT/tcache.part.* at the end, so a second call skips fla's ~250 s of compiles.
set -u
source "$(dirname "$0")/tcache.sh"  # tcache_restore / tcache_pack: the Triton cache between calls
SCRATCH=$(mktemp -d)
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$SCRATCH/tcache TRITON_CACHE_AUTOTUNING=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
tcache_restore "$TRITON_CACHE_DIR" || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SCRATCH/site" \
    .whl/fla_core-0.6.0-py3-none-any.whl
export PYTHONPATH=$SCRATCH/site:$PWD
start=$(date +%s)
timeout "${BENCH_TIMEOUT_S:-430}" python3 benchmarks/bench_kda.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s" >> "$OUT/bench.log"
start=$(date +%s)
KDAMOE_TEST_ON_GPU=1 timeout "${PYTEST_TIMEOUT_S:-120}" python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_kda_chunk.py tests/kernels/test_kda_recurrent.py tests/kernels/test_conv.py > "$OUT/pytest.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - start )) s" >> "$OUT/pytest.log"
tcache_pack "$TRITON_CACHE_DIR" "$OUT"
tail -n 3 "$OUT/bench.log" "$OUT/pytest.log"
