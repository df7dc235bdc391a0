#!/usr/bin/env bash
# One H200 device call for benchmarks/bench_e2e.py (issue #14): the training step (forward + loss + backward)
# of kdamoe against transformers' native KimiLinear (+ fla) at 8K and 32K, kdamoe's recipe shape, both shapes
# through kdamoe.training.train_graph.TrainStepGraph (the step replayed from a CUDA graph), and profiles of one kdamoe step at
# 32K and 8K; optionally benchmarks/model_parity.py first.
#   usage: bash benchmarks/device_e2e.sh [bench_e2e.py args...]   (writes under $OUT)
# Carry .whl/ (transformers 5.24.0 and fla_core 0.6.0 wheels; the device reaches no registry) and, when an earlier
# call returned them, .tcache/ (its tcache.part.* files: compiled Triton kernels and autotune choices).
# Environment: E2E_TOTAL_S (480: the whole call, s), E2E_ONLY (the bench parts, default kdamoe,native,recipe,graph,profile; native_graph on request;
# none: no bench, only the optional steps),
# E2E_PARITY (0; 1 runs benchmarks/model_parity.py first, limited to E2E_PARITY_S, default 150 s, taken from the
# bench's time: with a cold Triton cache it takes minutes, so it is off by default), E2E_TUNE (0; 1 first times every
# block config of the experts GEMMs, benchmarks/tuning/tune_moe_rows.py, limit E2E_TUNE_S = 150 s, with E2E_TUNE_ARGS, e.g.
# "--gemms gate_up,dw1,dw2"), E2E_NORM (0; 1 first runs benchmarks/tuning/tune_norm.py, limit E2E_NORM_S = 120 s),
# E2E_PYTEST (test files run after the bench with KDAMOE_TEST_ON_GPU=1, limit E2E_PYTEST_S = 200 s, taken from the
# bench's time; default none), E2E_FSDP (0; 1 runs
# benchmarks/bench_fsdp_overhead.py after the bench, limit E2E_FSDP_S = 240 s; carry data/shakespeare for it), E2E_LAUNCH
# (0; 1 first runs benchmarks/tuning/launch_overhead.py, limit 120 s: host µs per kernel launch, short path vs Triton's),
# E2E_PACK (1; 0 returns no Triton cache, e.g. on the last call of a session, and gives its 45 s to the bench).
# Files back: e2e.json, e2e.md, e2e.log (the output of every step), model_parity.json (E2E_PARITY=1),
# moe_rows_tune.json (E2E_TUNE=1), norm_tune.json (E2E_NORM=1), fsdp_overhead.json (E2E_FSDP=1), launch_overhead.json (E2E_LAUNCH=1) and at most four 15 MB parts of the Triton cache (more would pass the 8 files a call returns; then none are kept).
set -u
source "$(dirname "$0")/tcache.sh"  # tcache_restore / tcache_pack: the Triton cache between calls
T0=$(date +%s)
END=$(( T0 + ${E2E_TOTAL_S:-480} - (${E2E_PACK:-1} == 1 ? 45 : 5) ))  # the last 45 s pack the Triton cache
left() { echo $(( END - $(date +%s) )); }
SCRATCH=$(mktemp -d)
OUT=${OUT:-benchmarks/results}
LOG=$OUT/e2e.log
mkdir -p "$OUT" "$SCRATCH/tcache"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 HF_HOME=$SCRATCH/hf
export TRITON_CACHE_DIR=$SCRATCH/tcache TRITON_CACHE_AUTOTUNING=1 E2E_TCACHE_RESTORED=0
if tcache_restore "$TRITON_CACHE_DIR"; then
    export E2E_TCACHE_RESTORED=1
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SCRATCH/site" .whl/*.whl
else
    echo "no .whl/ wheels carried: the installed transformers (and fla, if any) are used" > "$LOG"
fi
export PYTHONPATH=$SCRATCH/site:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv >> "$LOG" 2>&1

if [ "${E2E_PARITY:-0}" = 1 ] && [ -f benchmarks/model_parity.py ]; then
    echo "== model parity, limit ${E2E_PARITY_S:-150} s" >> "$LOG"
    timeout "${E2E_PARITY_S:-150}" python3 benchmarks/model_parity.py --out "$OUT/model_parity.json" >> "$LOG" 2>&1
    echo "model parity exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
fi

if [ "${E2E_LAUNCH:-0}" = 1 ]; then
    echo "== launch overhead, limit 120 s" >> "$LOG"
    timeout 120 python3 benchmarks/tuning/launch_overhead.py --out "$OUT" >> "$LOG" 2>&1
    echo "launch overhead exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
fi

if [ "${E2E_TUNE:-0}" = 1 ]; then
    echo "== experts GEMM sweep, limit ${E2E_TUNE_S:-150} s" >> "$LOG"
    timeout "${E2E_TUNE_S:-150}" python3 benchmarks/tuning/tune_moe_rows.py --out "$OUT" --budget-s $(( ${E2E_TUNE_S:-150} - 10 )) \
        ${E2E_TUNE_ARGS:-} >> "$LOG" 2>&1
    echo "sweep exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
fi

if [ "${E2E_NORM:-0}" = 1 ]; then
    echo "== norm sweep, limit ${E2E_NORM_S:-120} s" >> "$LOG"
    timeout "${E2E_NORM_S:-120}" python3 benchmarks/tuning/tune_norm.py --out "$OUT" >> "$LOG" 2>&1
    echo "norm sweep exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
fi

pytest_s=$([ -n "${E2E_PYTEST:-}" ] && echo "${E2E_PYTEST_S:-200}" || echo 0)
budget=$(( $(left) - (${E2E_FSDP:-0} == 1 ? ${E2E_FSDP_S:-240} : 0) - pytest_s ))
if [ "${E2E_ONLY:-}" != none ] && [ "$budget" -lt 30 ]; then
    echo "== bench skipped: $budget s left for it (the earlier steps and the reserved time took the rest)" >> "$LOG"
elif [ "${E2E_ONLY:-}" != none ]; then
    echo "== bench, budget $budget s (Triton cache restored: $E2E_TCACHE_RESTORED)" >> "$LOG"
    # the bench's own deadline is 20 s before the kill, so a measurement that runs past its estimate is still saved
    timeout "$budget" python3 benchmarks/bench_e2e.py --out "$OUT" --budget-s $(( budget - 20 )) \
        --only "${E2E_ONLY:-kdamoe,native,recipe,graph,profile}" "$@" >> "$LOG" 2>&1
    echo "bench exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
fi

if [ -n "${E2E_PYTEST:-}" ]; then
    limit=$(( $(left) < pytest_s ? $(left) : pytest_s ))  # never into the time kept for packing the cache
    if [ "$limit" -lt 10 ]; then
        echo "== GPU tests skipped: $limit s left" >> "$LOG"
    else
        echo "== GPU tests, limit $limit s" >> "$LOG"
        KDAMOE_TEST_ON_GPU=1 timeout "$limit" python3 -m pytest -q -p no:cacheprovider --maxfail=20 \
            $E2E_PYTEST >> "$LOG" 2>&1
        echo "pytest exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
    fi
fi

if [ "${E2E_FSDP:-0}" = 1 ] && [ "$(left)" -lt 30 ]; then
    echo "== FSDP2 wrapper overhead skipped: $(left) s left" >> "$LOG"
elif [ "${E2E_FSDP:-0}" = 1 ]; then
    echo "== FSDP2 wrapper overhead, limit $(left) s" >> "$LOG"
    timeout "$(left)" python3 benchmarks/bench_fsdp_overhead.py --timeout-s $(( ($(left) - 10) / 2 )) --out "$OUT" \
        >> "$LOG" 2>&1
    echo "fsdp overhead exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
fi

rm -f "$OUT"/*.tmp  # a JSON write cut short by a timeout
if [ "${E2E_PACK:-1}" = 1 ]; then
    tcache_pack "$TRITON_CACHE_DIR" "$OUT"
fi
parts=$(ls "$OUT"/tcache.part.* 2>/dev/null | wc -l)
if [ "$parts" -gt 4 ]; then
    rm -f "$OUT"/tcache.part.*
    echo "Triton cache: $parts parts of 15 MB, more than the 4 that fit; not returned" >> "$LOG"
fi
rm -f "$OUT/moe_rows_tune.md" "$OUT/fsdp_overhead.md"  # their JSON holds the same rows (8 files per call)
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
    rm -f "$OUT"/tcache.part.*
    echo "more than the 8 files a call returns: the Triton cache is not returned" >> "$LOG"
fi
echo "done at $(( $(date +%s) - T0 )) s; Triton cache parts: $(ls "$OUT"/tcache.part.* 2>/dev/null | wc -l)" >> "$LOG"
tail -n 12 "$LOG"
if [ -f "$OUT/e2e.md" ]; then head -c 9000 "$OUT/e2e.md"; fi
