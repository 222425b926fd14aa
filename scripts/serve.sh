#!/usr/bin/env bash
# Serve the default model (smollm2-135m-instruct) with the vllm-adaptive plugin on.
#
# Usage: bash scripts/serve.sh [extra `vllm serve` args, e.g. --port 8123 --enforce-eager]
# Env:   ADAPTIVE_CONFIG        --additional-config JSON (default: {"adaptive": {}});
#                               VLLM_ADAPTIVE_CONFIG, its old name, still works (deprecated:
#                               vLLM warns about every VLLM_* variable it does not know)
#        VLLM_PLUGINS           vLLM's plugin allowlist (default: the plugin's three entry
#                               points, which turns on GET /v1/adaptive/requests/{tag}; set it
#                               to your own list, or to "" for stock vLLM)
#        VLLM_CPU_KVCACHE_SPACE CPU KV cache size in GiB (default: 4)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

if [ -n "${VLLM_ADAPTIVE_CONFIG+set}" ]; then
    if [ -z "${ADAPTIVE_CONFIG+set}" ]; then
        echo "[serve.sh] VLLM_ADAPTIVE_CONFIG is deprecated: name it ADAPTIVE_CONFIG" >&2
        ADAPTIVE_CONFIG=$VLLM_ADAPTIVE_CONFIG
    else
        echo "[serve.sh] VLLM_ADAPTIVE_CONFIG ignored: ADAPTIVE_CONFIG is set" >&2
    fi
    unset VLLM_ADAPTIVE_CONFIG # not vLLM's: it would warn "Unknown vLLM environment variable"
fi

bash "$root/scripts/setup-venv.sh"
dir=$("$root/.venv/bin/vllm-adaptive" models prepare smollm2-135m-instruct | tail -n 1)
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
# vLLM loads endpoint plugins (the per-request route) only when VLLM_PLUGINS names them, and
# warns at every start when it is unset; VLLM_PLUGINS is also the allowlist of the other plugin
# groups, so it names all three of the plugin's entry points.
export VLLM_PLUGINS=${VLLM_PLUGINS-vllm_adaptive,vllm_adaptive_metrics,vllm_adaptive_routes}
# (A literal `{"adaptive": {}}` inside ${...:-...} would mis-nest its braces.)
default_config='{"adaptive": {}}'
config=${ADAPTIVE_CONFIG:-$default_config}

exec "$root/.venv/bin/vllm" serve "$dir" \
    --served-model-name smollm2-135m-instruct \
    --additional-config "$config" \
    "$@"
