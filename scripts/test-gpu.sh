#!/usr/bin/env bash
# The GPU tier: every CUDA kernel test (the field's kernels, the project's Triton kernels, CUDA
# graph capture and replay), in the Python that has CUDA torch and triton. vLLM is not needed.
#
#   bash scripts/test-gpu.sh                  the tests
#   bash scripts/test-gpu.sh --bench DIR      also `kernels bench-gpu --out DIR` first
#
# GemLite is optional (pip install gemlite, or the `gpu` extra); its tests skip without it.
# PYTHON picks the interpreter (default: python3). Without a GPU every test here skips.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "${1:-}" = "--bench" ]; then
    "$py" -m vllm_adaptive.bench.kernels_gpu --out "$2" ${BENCH_ARGS:-} || echo "bench-gpu: exit $?"
    shift 2
fi
"$py" -c 'import torch; print("GPU:", torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch", torch.__version__)'
exec "$py" -m pytest -q -rs -p no:cacheprovider \
    tests/unit/test_cuda_kernels.py tests/unit/test_cuda_dispatch.py \
    tests/unit/test_triton_kernels.py tests/unit/test_masked_attention.py tests/unit/test_packed.py "$@"
