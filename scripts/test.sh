#!/usr/bin/env bash
# The project's test command (README, .ci/run): set up .venv (reused when the requirements are
# unchanged), prepare the default model, lint, run the tests.
#
#   bash scripts/test.sh           the default tier: tests/unit, tests/engine, tests/server
#   bash scripts/test.sh --all     the full suite: also tests/slow (bench end to end, training,
#                                  calibration CLI runs, the per-draft preemption matrix, Ray
#                                  Serve: installs the `ray` extra into .venv, ...)
#
# Other arguments go to pytest (e.g. `-k identity`, or a path). Two pytest workers share the
# two cores; each worker's engines are bound to their own core (tests/conftest.py).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

tier=(-m "not slow")
args=()
for a in "$@"; do
    if [ "$a" = "--all" ]; then tier=(); else args+=("$a"); fi
done
if [ ${#tier[@]} -eq 0 ]; then
    # the full suite runs the Ray Serve deployment test too: it needs the `ray` extra
    export ADAPTIVE_EXTRAS=${ADAPTIVE_EXTRAS:-cpu,dev,mlx,ray}
fi

bash scripts/setup-venv.sh
.venv/bin/vllm-adaptive models prepare smollm2-135m-instruct
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
.venv/bin/ruff check vllm_adaptive tests docs/experiments
exec .venv/bin/python -m pytest tests -q -rs -p no:cacheprovider --timeout=1800 \
    -n "${TEST_WORKERS:-2}" --dist loadfile --durations=15 ${tier[@]+"${tier[@]}"} \
    ${args[@]+"${args[@]}"}
