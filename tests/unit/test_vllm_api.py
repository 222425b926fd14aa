"""`vllm_adaptive.engine.vllm_api`, the one door to vLLM's names for the rest of the package:
its table resolves in the installed vLLM, says exactly who uses each name, and importing it
loads no vLLM."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_adaptive.engine import vllm_api

PACKAGE = Path(vllm_api.__file__).resolve().parents[1]
API = "vllm_adaptive.engine.vllm_api"


def _users() -> dict[str, set[str]]:
    """name -> the modules (relative to the package, dotted) that take it from vllm_api."""
    out: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if module.startswith("engine"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == API:
                for alias in node.names:
                    out.setdefault(alias.name, set()).add(module)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "vllm_api"
                and not node.attr.startswith("_")
            ):
                out.setdefault(node.attr, set()).add(module)
    return out


def test_every_name_lists_exactly_its_users():
    used = _users()
    functions = {"version"}  # plain functions of vllm_api, not table entries
    unknown = sorted(set(used) - set(vllm_api.NAMES) - functions)
    assert not unknown, f"taken from vllm_api but not in its NAMES: {unknown}"
    wrong = {
        name: {"listed": sorted(users), "actual": sorted(used.get(name, ()))}
        for name, (_, _, users) in vllm_api.NAMES.items()
        if set(users) != used.get(name, set())
    }
    assert not wrong, f"NAMES lists other users than the code has: {wrong}"


def test_every_name_resolves_in_this_vllm():
    pytest.importorskip("vllm")
    missing = []
    for name in vllm_api.NAMES:
        if name in vllm_api.CUDA_ONLY:
            continue
        try:
            value = getattr(vllm_api, name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {e}")
            continue
        assert vars(vllm_api)[name] is value  # resolved once, then a plain global
    assert not missing, "vLLM names that moved or went away:\n" + "\n".join(missing)
    with pytest.raises(AttributeError, match="add it to NAMES"):
        vllm_api.NotAVllmName  # noqa: B018


def test_importing_it_loads_no_vllm():
    code = (
        "import sys, vllm_adaptive.engine.vllm_api, vllm_adaptive.engine; "
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
