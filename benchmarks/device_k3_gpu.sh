#!/usr/bin/env bash
# One device call for benchmarks/bench_k3_gpu.py: kdamoe's Kimi K3 loader against NeMo AutoModel 0.7.0's own K3 in
# bf16 with fla's Triton kernels, on the tiny K3 of tests/fixtures/k3_tiny and a larger random K3-shaped model.
#   usage: bash benchmarks/device_k3_gpu.sh [bench_k3_gpu.py args...]   (writes under $OUT)
# The device reaches no registry: carry .whl/ with, besides the fla_core-0.6.0, transformers-5.25.0, huggingface_hub
# 2.4.0 (+ httpx2, httpcore2, truststore, click, hf_xet), kernels-0.19.1, einops, trl, datasets, dill and multiprocess
# wheels already there, NeMo AutoModel's wheel, fetched once on a machine with network (it is pure Python, 3.8 MB,
# sha256 37b8397a73c17e4a8bffd0cd3becc0507abecc1ebfea3b3eb6468eed57ba6674):
#   python -m pip download --no-deps nemo-automodel==0.7.0 -d .whl
# It installs with --no-deps: its kimi_k3 model, config and state-dict adapter import, besides torch, transformers,
# fla and einops, only packages the GPU image has (numpy, safetensors, pyyaml, ...) or .whl/ carries (dill,
# huggingface_hub's httpx2 / httpcore2 / truststore, kernels). pydantic, which the image lacks, is imported under
# try/except by nemo_automodel/__init__.py only to silence a warning. The declared dependencies that are absent
# (megatron-fsdp, mistral-common, torchdata, torchao, flashoptim, quack-kernels, transformers==5.18) are not imported
# on this path: NeMo runs with BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", experts="torch").
# Wheels stay out of git (.whl/ is ignored). Also carry, when an earlier call returned them, .tcache/ (its
# tcache.part.* files: compiled Triton kernels and autotune choices, fla's included).
# Environment: K3GPU_TOTAL_S (400: the whole call, s), K3GPU_PACK (1; 0 returns no Triton cache). Files back:
# k3_gpu.json, k3_gpu.md, k3_gpu.log and the Triton cache parts.
set -u
source "$(dirname "$0")/tcache.sh"  # the Triton cache between calls; device_start / _wheels / _bench / _finish
device_start "${K3GPU_TOTAL_S:-400}" "${K3GPU_PACK:-1}" k3_gpu.log
if ! ls .whl/nemo_automodel-0.7.0-*.whl .whl/fla_core-*.whl >/dev/null 2>&1; then
    echo "no .whl/nemo_automodel-0.7.0 or fla_core wheel carried: NeMo's rows will record the import error" >> "$LOG"
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    if ! device_wheels .whl/*.whl; then  # one wheel for another Python fails the whole command
        echo "installing every carried wheel failed; trying the ones this script needs alone" >> "$LOG"
        device_wheels $(ls .whl/nemo_automodel-*.whl .whl/fla_core-*.whl .whl/einops-*.whl .whl/transformers-*.whl \
            .whl/huggingface_hub-*.whl .whl/httpx2-*.whl .whl/httpcore2-*.whl .whl/truststore-*.whl \
            .whl/kernels-*.whl .whl/dill-*.whl 2>/dev/null)
    fi
fi
export PYTHONPATH=$SCRATCH/site:$PWD  # nemo_automodel and fla import from here
python3 -c "import nemo_automodel, fla, transformers, torch; print('nemo_automodel', nemo_automodel.__version__, \
'fla', fla.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)" >> "$LOG" 2>&1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$LOG" 2>&1
device_bench benchmarks/bench_k3_gpu.py "$@"
device_finish "${K3GPU_PACK:-1}"
if [ -f "$OUT/k3_gpu.md" ]; then head -c 6000 "$OUT/k3_gpu.md"; fi
