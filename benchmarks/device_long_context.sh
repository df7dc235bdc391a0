#!/usr/bin/env bash
# One H200 device call for benchmarks/bench_long_context.py: kdamoe vs transformers' native KimiLinear (+ fla),
# prefill and decode to 1M tokens, the MLA attention floor and a decode profile; then a short run of the GPU
# preset (kdamoe/configs/gpu_h200.yaml, one 2K stage) whose final/ model the greedy check reads (single-pass
# prefill + eager decode against chunked prefill + CUDA-graph decode).
#   usage: bash benchmarks/device_long_context.sh [bench_long_context.py args...]   (writes under $OUT)
# Carry .whl/ (transformers 5.24.0 and fla_core 0.6.0 wheels; the device reaches no registry), data/shakespeare
# (the corpus, for the training run and the held-out prompt) and, from the second call on, .tcache/ (the
# tcache.part.* files the previous call returned: compiled Triton kernels and autotune choices).
# Environment: LC_TOTAL_S (570: the whole call, s), LC_PYTEST (1: the GPU tests first, LC_PYTEST_S 200), LC_TRAIN (1; 0 skips training and the greedy check),
# LC_TRAIN_STEPS (60), LC_TRAIN_ARGS (more kdamoe-train arguments, e.g. "--set train.stages.0.seq_len=1024"),
# LC_TRAIN_RESERVE_S (200: kept from the bench for training + greedy), LC_ONLY (the bench parts before training;
# default profile,floor,kdamoe,native; none: only the training run and the greedy check), LC_CHUNK2 (extra kdamoe chunk lengths at 1M, e.g. 131072), LC_MODEL_DIR
# (a carried final/ folder: LC_TRAIN=0 LC_ONLY=greedy checks it).
# Files back: long_context.json, long_context.md, bench.log (the output of every step) and at most five 15 MB
# parts of the Triton cache (more would pass the 8 files a call returns; then none are kept).
set -u
source "$(dirname "$0")/tcache.sh"  # tcache_restore / tcache_pack: the Triton cache between calls
T0=$(date +%s)
END=$(( T0 + ${LC_TOTAL_S:-570} - 30 ))  # the last 30 s pack the Triton cache
left() { echo $(( END - $(date +%s) )); }
SCRATCH=$(mktemp -d)
OUT=${OUT:-benchmarks/results}
LOG=$OUT/bench.log
mkdir -p "$OUT" "$SCRATCH/tcache"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 HF_HOME=$SCRATCH/hf
export TRITON_CACHE_DIR=$SCRATCH/tcache TRITON_CACHE_AUTOTUNING=1 LC_TCACHE_RESTORED=0
if tcache_restore "$TRITON_CACHE_DIR"; then
    export LC_TCACHE_RESTORED=1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SCRATCH/site" .whl/*.whl
export PYTHONPATH=$SCRATCH/site:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv > "$LOG" 2>&1
if [ "${LC_PYTEST:-1}" = 1 ]; then  # the GPU tests of graph decoding and the latent kernel, first
    KDAMOE_TEST_ON_GPU=1 timeout "${LC_PYTEST_S:-200}" python3 -m pytest -q -p no:cacheprovider --maxfail=20 \
        ${LC_PYTEST_TESTS:-tests/test_gpu_long_context.py tests/kernels/test_mla_decode.py} >> "$LOG" 2>&1
    echo "pytest exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
fi

train=${LC_TRAIN:-1}
budget=$(( $(left) - (train == 1 ? ${LC_TRAIN_RESERVE_S:-200} : 0) ))
if [ "${LC_ONLY:-}" != none ]; then
    echo "== bench, budget $budget s (Triton cache restored: $LC_TCACHE_RESTORED)" >> "$LOG"
    timeout $(( budget + 30 )) python3 benchmarks/bench_long_context.py --out "$OUT" --budget-s "$budget" \
        --only "${LC_ONLY:-profile,floor,kdamoe,native}" "$@" >> "$LOG" 2>&1
    echo "bench exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
fi

if [ "$train" = 1 ]; then
    RUN=$SCRATCH/lc_train
    train_s=$(( $(left) - 60 ))  # the greedy check gets the last minute
    echo "== training, limit $train_s s" >> "$LOG"
    timeout "$train_s" python3 -m kdamoe.cli --config gpu_h200.yaml --output-dir "$RUN" --no-resume \
        --set "train.stages=[{name: short, seq_len: 2048, batch_size: 16, steps: ${LC_TRAIN_STEPS:-60}, lr: 1.5e-3, warmup_steps: 6}]" \
        --set train.checkpoint_every=0 --set eval.max_rows=8 --set generate.max_new_tokens=32 ${LC_TRAIN_ARGS:-} \
        >> "$LOG" 2>&1
    echo "training exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
    budget=$(left)
    echo "== greedy check, budget $budget s" >> "$LOG"
    timeout $(( budget + 20 )) python3 benchmarks/bench_long_context.py --out "$OUT" --budget-s "$budget" \
        --only greedy --model-dir "$RUN/final" "$@" >> "$LOG" 2>&1
    echo "greedy exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
fi

rm -f "$OUT"/*.tmp  # a JSON write cut short by a timeout
tcache_pack "$TRITON_CACHE_DIR" "$OUT"
parts=$(ls "$OUT"/tcache.part.* 2>/dev/null | wc -l)
if [ "$parts" -gt 5 ]; then
    rm -f "$OUT"/tcache.part.*
    echo "Triton cache: $parts parts of 15 MB, more than the 5 that fit; not returned" >> "$LOG"
fi
echo "done at $(( $(date +%s) - T0 )) s; Triton cache parts: $(ls "$OUT"/tcache.part.* 2>/dev/null | wc -l)" >> "$LOG"
tail -n 12 "$LOG"
head -c 9000 "$OUT/long_context.md"
