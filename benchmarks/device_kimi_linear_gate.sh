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
source "$(dirname "$0")/tcache.sh"  # the Triton cache between calls; device_start / _wheels / _bench / _finish
device_start "${GATE_TOTAL_S:-420}" "${GATE_PACK:-1}" gate.log
if ls .whl/*.whl >/dev/null 2>&1; then
    if ! device_wheels .whl/*.whl; then  # one wheel for another Python fails the whole command
        echo "installing every carried wheel failed; trying fla_core, einops and transformers alone" >> "$LOG"
        device_wheels $(ls .whl/fla_core-*.whl .whl/einops-*.whl .whl/transformers-*.whl 2>/dev/null)
    fi
else
    echo "no .whl/ wheels carried: the installed transformers (and fla, if any) are used" >> "$LOG"
fi
export PYTHONPATH=$SCRATCH/site:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv >> "$LOG" 2>&1
device_bench benchmarks/bench_kimi_linear_gate.py "$@"
device_finish "${GATE_PACK:-1}"
if [ -f "$OUT/kimi_linear_gate.md" ]; then head -c 6000 "$OUT/kimi_linear_gate.md"; fi
