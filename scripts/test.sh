#!/usr/bin/env bash
# The project's test command (README, .ci/run): set up .venv (reused when the
# requirements are unchanged), prepare the default model, lint, run the tests.
# Engines are session fixtures, so the whole suite starts only a handful.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

bash scripts/setup-venv.sh
.venv/bin/vllm-adaptive models prepare smollm2-135m-instruct
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
.venv/bin/ruff check vllm_adaptive tests
exec .venv/bin/python -m pytest tests -q -rs -p no:cacheprovider --timeout=1800 "$@"
