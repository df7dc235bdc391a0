# One device call: benchmarks/check_engine_graphs.py (the engine's CUDA-graph decode steps checked against the same
# static steps run eagerly, then timed at 1, 8, 64 and 32 slots). Wheels: transformers and its hub dependencies only
# (no TRL). Usage from the repo root, with .whl/ and .tcache/ carried:
#   GRAPHS_TOTAL_S=80 GRAPHS_PACK=0 bash benchmarks/device_engine_graphs.sh
set -u
source "$(dirname "$0")/tcache.sh"  # the Triton cache between calls; device_start / _wheels / _bench / _finish
device_start "${GRAPHS_TOTAL_S:-240}" "${GRAPHS_PACK:-1}" engine_graphs.log
device_wheels .whl/transformers-*.whl .whl/huggingface_hub-*.whl .whl/httpx2-*.whl .whl/httpcore2-*.whl \
    .whl/truststore-*.whl .whl/click-*.whl .whl/hf_xet-*.whl \
    || { echo "wheel install failed" >> "$LOG"; tail -n 20 "$LOG"; exit 1; }
export PYTHONPATH=$SCRATCH/site:$PWD
device_bench benchmarks/check_engine_graphs.py "$@"
device_finish "${GRAPHS_PACK:-1}"
if [ -f "$OUT/engine_graphs.json" ]; then head -c 9000 "$OUT/engine_graphs.json"; fi
