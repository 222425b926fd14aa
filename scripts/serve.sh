#!/usr/bin/env bash
# Serve the default model (smollm2-135m-instruct) with the vllm-adaptive plugin on.
#
# Usage: bash scripts/serve.sh [extra `vllm serve` args, e.g. --port 8123 --enforce-eager]
# Env:   VLLM_ADAPTIVE_CONFIG   --additional-config JSON (default: {"adaptive": {}})
#        VLLM_CPU_KVCACHE_SPACE CPU KV cache size in GiB (default: 4)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

bash "$root/scripts/setup-venv.sh"
dir=$("$root/.venv/bin/vllm-adaptive" models prepare smollm2-135m-instruct | tail -n 1)
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
# (A literal `{"adaptive": {}}` inside ${...:-...} would mis-nest its braces.)
default_config='{"adaptive": {}}'
config=${VLLM_ADAPTIVE_CONFIG:-$default_config}

exec "$root/.venv/bin/vllm" serve "$dir" \
    --served-model-name smollm2-135m-instruct \
    --additional-config "$config" \
    "$@"
