#!/usr/bin/env bash
# One device call for benchmarks/bench_kimi_linear_gate.py: one KDA layer with Kimi Linear's unbounded gate at
# Kimi-Linear-48B widths, kdamoe's layer (fla's KDA ops) vs transformers' native KimiLinearDeltaAttention (+ fla),
# forward+backward at 4K / 16K and decode steps on a 4K state.
#   usage: bash benchmarks/device_kimi_linear_gate.sh [bench_kimi_linear_gate.py args...]   (writes under $OUT)
# Carry .whl/ (the fla_core 0.6.0 wheel, and transformers' if the image's is older than kdamoe needs; the device
# reaches no registry) and, when an earlier call returned them, .tcache/ (its tcache.part.* files: compiled Triton
# kernels and autotune choices). fla must import before transformers' kimi_linear module: transformers binds fla's
# ops when that module is first imported. Environment: GATE_TOTAL_S (420: the whole call, s), GATE_PACK (1; 0 returns
# no Triton cache). Files back: kimi_linear_gate.json, kimi_linear_gate.md, gate.log and the Triton cache parts.
set -u
source "$(dirname "$0")/tcache.sh"  # tcache_restore / tcache_pack: the Triton cache between calls
T0=$(date +%s)
END=$(( T0 + ${GATE_TOTAL_S:-420} - (${GATE_PACK:-1} == 1 ? 45 : 5) ))  # the last 45 s pack the Triton cache
SCRATCH=$(mktemp -d)
OUT=${OUT:-benchmarks/results}
LOG=$OUT/gate.log
mkdir -p "$OUT" "$SCRATCH/tcache"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 HF_HOME=$SCRATCH/hf
export TRITON_CACHE_DIR=$SCRATCH/tcache TRITON_CACHE_AUTOTUNING=1
tcache_restore "$TRITON_CACHE_DIR" || true
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SCRATCH/site"
if ls .whl/*.whl >/dev/null 2>&1; then
    if ! $PIP .whl/*.whl >> "$LOG" 2>&1; then  # one wheel for another Python fails the whole command
        echo "installing every carried wheel failed; trying fla_core, einops and transformers alone" >> "$LOG"
        $PIP $(ls .whl/fla_core-*.whl .whl/einops-*.whl .whl/transformers-*.whl 2>/dev/null) >> "$LOG" 2>&1
    fi
else
    echo "no .whl/ wheels carried: the installed transformers (and fla, if any) are used" >> "$LOG"
fi
export PYTHONPATH=$SCRATCH/site:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv >> "$LOG" 2>&1
budget=$(( END - $(date +%s) ))
echo "== bench, budget $budget s" >> "$LOG"
# the bench's own deadline is 20 s before the kill, so a measurement that runs past its estimate is still saved
timeout "$budget" python3 benchmarks/bench_kimi_linear_gate.py --out "$OUT" --budget-s $(( budget - 20 )) "$@" \
    >> "$LOG" 2>&1
echo "bench exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
rm -f "$OUT"/*.tmp  # a JSON write cut short by a timeout
if [ "${GATE_PACK:-1}" = 1 ]; then
    tcache_pack "$TRITON_CACHE_DIR" "$OUT"
fi
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
    rm -f "$OUT"/tcache.part.*
    echo "more than the 8 files a call returns: the Triton cache is not returned" >> "$LOG"
fi
tail -n 12 "$LOG"
if [ -f "$OUT/kimi_linear_gate.md" ]; then head -c 6000 "$OUT/kimi_linear_gate.md"; fi
