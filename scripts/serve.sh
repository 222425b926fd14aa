#!/usr/bin/env bash
# Serve the default model (smollm2-135m-instruct) with the vllm-adaptive plugin on.
#
# Usage: bash scripts/serve.sh [extra `vllm serve` args, e.g. --port 8123 --enforce-eager]
#
# Defaults follow what `vllm-adaptive bench-serve` measured (docs/results.md): the dtype and
# config that serve fastest on this CPU with greedy output identical to stock vLLM's at that
# dtype.
#   - CPUs with native bf16 (avx512_bf16 / amx_bf16): the checkpoint's own bf16, the fastest
#     stock setting there, with the plugin's mechanisms off ({"adaptive": {}}); the fp16 gear
#     reads as many weight bytes as bf16 and its float32 compute changes the text.
#   - Other CPUs (AVX2): --dtype float32, the fastest stock setting there, with the fixed fp16
#     gear ({"adaptive": {"precision": {"policy": "fixed", "gear": "fp16"}}}): half the weight
#     bytes, text identical to stock float32's; and vLLM's suffix-decoding drafter while one
#     request runs (--speculative-config '{"method": "suffix", ...}', lossless: the target
#     verifies every draft), which Arctic Inference provides: built into .venv on first use
#     (scripts/install-suffix-decoding.sh, about a minute).
# A --dtype of your own picks the config for that dtype; ADAPTIVE_CONFIG overrides the config
# (and then no drafter is added unless ADAPTIVE_DRAFTS asks); a --speculative-config of your own
# replaces the drafter.
# Env:   ADAPTIVE_MODEL         a model `vllm-adaptive models list` names (default
#                               smollm2-135m-instruct; also its served name)
#        ADAPTIVE_CONFIG        --additional-config JSON (default: see above);
#                               VLLM_ADAPTIVE_CONFIG, its old name, still works (deprecated:
#                               vLLM warns about every VLLM_* variable it does not know)
#        VLLM_PLUGINS           vLLM's plugin allowlist (default: the plugin's three entry
#                               points, which turns on GET /v1/adaptive/requests/{tag}; set it
#                               to your own list, or to "" for stock vLLM)
#        ADAPTIVE_DRAFTS        "suffix" or "none": vLLM's suffix drafter on or off (default:
#                               on with the float32 default config above, off otherwise)
#        VLLM_CPU_KVCACHE_SPACE CPU KV cache size in GiB (default: 4)
#        VLLM_USE_AOT_COMPILE   vLLM's AOT compile cache (default here: 0, see below)
#        TORCHINDUCTOR_CACHE_DIR the compiled model's cache (default: under VLLM_CACHE_ROOT)
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

# The dtype: the user's --dtype, else the fastest stock dtype of this CPU.
dtype=""
prev=""
users_spec=""
for a in "$@"; do
    case "$a" in --dtype=*) dtype=${a#--dtype=} ;; --speculative-config*|-sc|-sc=*) users_spec=1 ;; esac
    [ "$prev" = "--dtype" ] && dtype=$a
    prev=$a
done
dtype_args=()
if [ -z "$dtype" ]; then
    flags=${SERVE_CPU_FLAGS:-$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)}
    if grep -qwE 'avx512_bf16|amx_bf16' <<<"$flags"; then
        dtype=auto
    else
        dtype=float32
        dtype_args=(--dtype float32)
    fi
fi
# (A literal `{"adaptive": {}}` inside ${...:-...} would mis-nest its braces.)
case "$dtype" in
    float32|float) default_config='{"adaptive": {"precision": {"policy": "fixed", "gear": "fp16"}}}' ;;
    *) default_config='{"adaptive": {}}' ;;
esac
config=${ADAPTIVE_CONFIG:-$default_config}
model=${ADAPTIVE_MODEL:-smollm2-135m-instruct}
# The drafter: vLLM's suffix decoding where bench-serve measured it paying with text identical
# to stock's (the float32 default: drafts verified in float32 keep stock's greedy text; in bf16
# a verify step of several tokens rounds differently), its global cache off as measured.
drafts=${ADAPTIVE_DRAFTS:-}
if [ -z "$drafts" ]; then
    drafts=none
    # (not for stock vLLM, VLLM_PLUGINS="": serve.sh then serves what vLLM alone would)
    [ -z "${ADAPTIVE_CONFIG:-}" ] && [ "$config" = "$default_config" ] && \
        [ "${VLLM_PLUGINS-unset}" != "" ] && \
        case "$dtype" in float32|float) drafts=suffix ;; esac
fi
case "$drafts" in
    suffix|none) ;;
    *) echo "[serve.sh] ADAPTIVE_DRAFTS must be \"suffix\" or \"none\", got \"$drafts\"" >&2; exit 2 ;;
esac
[ -n "$users_spec" ] && drafts=none  # the user's own --speculative-config
suffix_spec='{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 0}'
# Drafts only while one request runs: verifying up to 9 tokens per request turns the step
# compute-bound from a few requests on (chat requests on an AVX2 EPYC: 0.81x the fp16 gear's
# output tok/s at 4 requests, 0.91x at 32); vLLM's per-batch-size schedule turns them off above.
# vLLM 0.32's own suffix proposer cannot follow a schedule (it asserts a fixed k); the plugin's
# adaptive model classes fix that (intrusion suffix-dynamic-k), so only with an adaptive config.
[[ $config == *'"adaptive"'* ]] && \
    suffix_spec=${suffix_spec%\}}', "num_speculative_tokens_per_batch_size": [[1, 1, 8], [2, 1024, 0]]}'
spec=none
[ "$drafts" = suffix ] && spec=$suffix_spec
if [ -n "${SERVE_DRY_RUN:-}" ]; then  # what would be served, without serving it (tests)
    printf 'dtype %s\nconfig %s\nmodel %s\nspec %s\n' "$dtype" "$config" "$model" "$spec"
    exit 0
fi

bash "$root/scripts/setup-venv.sh"
spec_args=()
if [ "$spec" != none ]; then
    if ! "$root/.venv/bin/python" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
        echo "[serve.sh] building Arctic Inference's suffix decoding for the drafter (about a minute)" >&2
        bash "$root/scripts/install-suffix-decoding.sh" >&2 || {
            echo "[serve.sh] could not build Arctic Inference: serving WITHOUT drafts" \
                "(ADAPTIVE_DRAFTS=none silences this)" >&2
            spec=none
        }
    fi
    [ "$spec" != none ] && spec_args=(--speculative-config "$spec")
fi
dir=$("$root/.venv/bin/vllm-adaptive" models prepare "$model" | tail -n 1)
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
# The compile cache: vLLM 0.32's AOT artifact never loads on CPU ("'function' object has no
# attribute 'finalize_loading'", stock alike), so every start compiled the model again; its
# older path reuses Inductor's own cache, kept beside vLLM's (torch's default is under /tmp):
# a warm restart 41 s instead of 77 (docs/serving.md).
export VLLM_USE_AOT_COMPILE=${VLLM_USE_AOT_COMPILE:-0}
vllm_cache=${VLLM_CACHE_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$vllm_cache/torch_compile_cache/inductor}
# vLLM loads endpoint plugins (the per-request route) only when VLLM_PLUGINS names them, and
# warns at every start when it is unset; VLLM_PLUGINS is also the allowlist of the other plugin
# groups, so it names all three of the plugin's entry points.
export VLLM_PLUGINS=${VLLM_PLUGINS-vllm_adaptive,vllm_adaptive_metrics,vllm_adaptive_routes}

# The plugin's C++ kernels for this CPU, built once per machine before vLLM starts (about a
# minute the first time), not inside the engine's start where vLLM would wait on them; a build
# that fails leaves the engine on its torch / FBGEMM paths (the command says why).
if [ -n "$VLLM_PLUGINS" ]; then
    "$root/.venv/bin/vllm-adaptive" kernels build >/dev/null || true
fi

cmd=("$root/.venv/bin/vllm" serve "$dir" --served-model-name "$model"
     ${dtype_args[@]+"${dtype_args[@]}"} --additional-config "$config"
     ${spec_args[@]+"${spec_args[@]}"} "$@")
exec "${cmd[@]}"
