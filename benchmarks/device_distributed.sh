#!/usr/bin/env bash
# One 2 x H200 device call for benchmarks/bench_distributed.py (issue #17): the pretraining job (GPU preset) and the
# SFT recipe on 2 processes (ddp, fsdp2, fsdp2_ep) against one process of the same job, NCCL, in one call.
#   usage: bash benchmarks/device_distributed.sh [bench_distributed.py args...]   (writes under $OUT)
# Carry .whl/ (the device reaches no registry: transformers 5.24.0, trl 1.16.0, datasets 5.2.0, dill 0.4.1,
# multiprocess 0.70.19 wheels; see benchmarks/device_long_rl.sh for the pip download command), data/shakespeare
# (the pretraining corpus) and, when an earlier call returned them, .tcache/ (its tcache.part.* files: compiled
# Triton kernels; without them the first training step compiles for about 95 s).
# Environment: DIST_TOTAL_S (570: the whole call, s).
# Files back: distributed.json, distributed.md (rewritten after every run), distributed.log (this script and the
# bench), distributed_jobs.log (every launch's output, timestamped) and at most four 15 MB parts of the Triton cache.
set -u
source "$(dirname "$0")/tcache.sh"  # tcache_restore / tcache_pack: the Triton cache between calls
T0=$(date +%s)
END=$(( T0 + ${DIST_TOTAL_S:-570} - 45 ))  # the last 45 s pack the Triton cache
left() { echo $(( END - $(date +%s) )); }
SCRATCH=$(mktemp -d)
OUT=${OUT:-benchmarks/results}
LOG=$OUT/distributed.log
mkdir -p "$OUT" "$SCRATCH/tcache"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 HF_HOME=$SCRATCH/hf TRL_EXPERIMENTAL_SILENCE=1
# every launch of the bench (and every rank) reads and writes this one cache: the one-process runs compile first
export TRITON_CACHE_DIR=$SCRATCH/tcache TRITON_CACHE_AUTOTUNING=1
export NCCL_NVLS_ENABLE=0  # NVLink multicast (NVLS) stays off on these machines
if tcache_restore "$TRITON_CACHE_DIR"; then echo "Triton cache restored" >> "$LOG"; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SCRATCH/site" \
    .whl/*.whl >> "$LOG" 2>&1 || { echo "wheel install failed" >> "$LOG"; exit 1; }
export PYTHONPATH=$SCRATCH/site:$PWD
python3 -c "import trl, datasets, transformers, tensorboard, torch; print('trl', trl.__version__, 'transformers', \
transformers.__version__, 'torch', torch.__version__, 'GPUs', torch.cuda.device_count())" >> "$LOG" 2>&1 \
    || { echo "trl / datasets / transformers / tensorboard missing" >> "$LOG"; exit 1; }
ls data/shakespeare/*.txt >/dev/null 2>&1 || { echo "data/shakespeare not carried" >> "$LOG"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv >> "$LOG" 2>&1
nvidia-smi topo -m >> "$LOG" 2>&1

budget=$(left)
echo "== bench, budget $budget s" >> "$LOG"
# the bench's own deadline is 20 s before the kill, so the results of the runs before it are written whole
timeout "$budget" python3 benchmarks/bench_distributed.py --out "$OUT" --budget-s $(( budget - 20 )) "$@" >> "$LOG" 2>&1
echo "bench exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"

rm -f "$OUT"/*.tmp  # a write cut short by the timeout
tcache_pack "$TRITON_CACHE_DIR" "$OUT"
parts=$(ls "$OUT"/tcache.part.* 2>/dev/null | wc -l)
if [ "$parts" -gt 4 ] || [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
    rm -f "$OUT"/tcache.part.*
    echo "Triton cache: $parts parts of 15 MB, more than fit the 8 files a call returns; not returned" >> "$LOG"
fi
echo "done at $(( $(date +%s) - T0 )) s; Triton cache parts: $(ls "$OUT"/tcache.part.* 2>/dev/null | wc -l)" >> "$LOG"
tail -n 12 "$LOG"
head -c 9000 "$OUT/distributed.md"
