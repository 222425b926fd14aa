#!/usr/bin/env bash
# Build Snowflake's arctic-inference (its suffix-decoding C++ extension only, no CUDA ops) into
# .venv, for `vllm-adaptive bench --spec '{"method": "suffix", "k": 8}'` (vLLM's suffix method).
# Not part of the default setup: the bench's other rows and the tests do not need it. The
# package also declares a vLLM plugin; it does nothing unless ARCTIC_INFERENCE_ENABLED=1.
# Build-only requirements go to a scratch directory, not the venv. About a minute on 2 cores.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py="$root/.venv/bin/python"
version=${ARCTIC_INFERENCE_VERSION:-0.3.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m pip install -q --target "$work/deps" "nanobind==2.9.2" ninja wheel
"$py" -m pip download -q --no-deps --no-binary arctic-inference -d "$work/src" "arctic-inference==$version"
tar -xzf "$work/src"/arctic_inference-*.tar.gz -C "$work/src"
cd "$work/src/arctic_inference-$version"
PYTHONPATH="$work/deps" PATH="$work/deps/bin:$PATH" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheel" .
"$py" -m pip install -q --no-deps "$work/wheel"/arctic_inference-*.whl
cd "$root"
"$py" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; print('suffix decoding: ok')"
