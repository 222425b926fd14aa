"""The package's import graph, read from source with `ast` (nothing is imported).

Four rules (issue 16, items 2 and 4):

1. No import cycles, between modules or between subpackages (``vllm_adaptive.depth``,
   ``vllm_adaptive.m2r2``, ...; a top-level module is its own unit).
2. Offline code (calibration, adapter training, corpora, model preparation, the artifact
   format) imports no vLLM, nothing of ``vllm_adaptive.bench`` and nothing of the engine glue
   (``vllm_adaptive.engine``, which hands out vLLM's names), directly or through other package
   modules. Offline code runs in transformers on machines without vLLM's engine and shares
   nothing with the engine but ``vllm_adaptive.artifacts``.
3. Only modules under ``vllm_adaptive.engine`` import vLLM; the rest of the package gets vLLM's
   names from ``vllm_adaptive.engine.vllm_api``.
4. The glue sits on top of the algorithms, as Arctic Inference's ``vllm/`` sits on its
   ``common/``: the algorithms (``ALGORITHMS``: depth policies and KV strategies, precision
   policies and plans, MoE tiers and predictors, kernels, M2R2) import nothing of the glue
   (``GLUE``: the engine glue, the model classes, the attention backend, the bench and the CLI),
   directly or through other package modules. What they need of the engine comes in as
   arguments (`depth/attention_port.StepAttention`) or is handed to them at plugin load
   (`kernels/library.py`); the glue imports them and calls them.

Every import counts, wherever it is written (module level or inside a function), and so does
``importlib.import_module`` / ``__import__`` of a literal name; only imports under
``if TYPE_CHECKING:`` are left out, since they never run. Importing a module also runs its
parent packages' ``__init__``, so those count for rules 2 and 4.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "vllm_adaptive"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

#: Offline modules. A new calibration or training module belongs here.
OFFLINE = (
    # the file format shared with the engine, and the text it is calibrated on
    "vllm_adaptive.artifacts",
    "vllm_adaptive.corpora",
    # model preparation
    "vllm_adaptive.model_zoo",
    "vllm_adaptive.w8a8_checkpoint",
    # adaptive-depth calibration
    "vllm_adaptive.depth.calibration",
    "vllm_adaptive.depth.calibration.args",
    "vllm_adaptive.depth.calibration.budget",
    "vllm_adaptive.depth.calibration.emad",
    "vllm_adaptive.depth.calibration.quicksilver",
    "vllm_adaptive.depth.calibration.river",
    "vllm_adaptive.depth.calibration.fusion",
    "vllm_adaptive.depth.calibration.collect",
    "vllm_adaptive.depth.calibration.fusion_reference",
    "vllm_adaptive.depth.isotonic",
    "vllm_adaptive.depth.calibration.norms",
    "vllm_adaptive.depth.policies.fusion",
    "vllm_adaptive.depth.proxies",
    "vllm_adaptive.depth.readout",
    "vllm_adaptive.depth.calibration.signal_arrays",
    "vllm_adaptive.depth.calibration.targets",
    # adapter training
    "vllm_adaptive.m2r2.args",
    "vllm_adaptive.m2r2.train",
    "vllm_adaptive.m2r2.objective",
    # EAGLE-3 draft heads: the format and their training
    "vllm_adaptive.speculative.eagle3_head",
    "vllm_adaptive.speculative.draft_args",
    "vllm_adaptive.speculative.train_eagle3",
    "vllm_adaptive.speculative.eagle3_draft",
    "vllm_adaptive.speculative.eagle3_data",
    # MoEfying, its quality evaluation and the M2R2 expert-prediction adapters' training
    "vllm_adaptive.moe.args",
    "vllm_adaptive.moe.collect",
    "vllm_adaptive.moe.m2r2",
    "vllm_adaptive.moe.moefy",
    "vllm_adaptive.moe.quality",
    "vllm_adaptive.moe.reference",
    # W8A8 smoothing calibration
    "vllm_adaptive.precision.smoothing",
    # the logit-lens oracle (transformers only)
    "vllm_adaptive.oracle",
)
#: Package modules offline code must not reach (besides vLLM itself).
FORBIDDEN_OFFLINE = ("vllm_adaptive.bench", "vllm_adaptive.engine")

#: The engine glue (rule 3: the only importer of vLLM).
ENGINE = "vllm_adaptive.engine"
#: Rule 4: the algorithms, and the glue above them that they must not reach. What subclasses
#: vLLM's classes (model classes, the attention backend, the geared linear method) is glue.
ALGORITHMS = tuple(
    f"vllm_adaptive.{name}" for name in ("depth", "precision", "moe", "kernels", "m2r2")
)
GLUE = tuple(f"vllm_adaptive.{name}" for name in ("engine", "models", "attention", "bench", "cli"))


@dataclass
class ImportGraph:
    modules: dict[str, Path]
    #: module -> {imported package module: line of the first such import}
    internal: dict[str, dict[str, int]] = field(default_factory=dict)
    #: module -> {imported outside module (full dotted name): line}
    external: dict[str, dict[str, int]] = field(default_factory=dict)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _dynamic_import(node: ast.AST) -> str | None:
    """The literal module name of ``importlib.import_module("x")`` / ``__import__("x")``."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = ast.unparse(node.func)
    arg = node.args[0]
    if func.rpartition(".")[2] in ("import_module", "__import__") and isinstance(arg, ast.Constant):
        return arg.value if isinstance(arg.value, str) else None
    return None


def _imports(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import, at any depth, except those under ``if TYPE_CHECKING:``; an import of a
    literal name through ``importlib.import_module`` / ``__import__`` as an ``import`` of it."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child
            elif (name := _dynamic_import(child)) is not None:
                yield ast.Import(names=[ast.alias(name=name)], lineno=child.lineno)
            stack.append(child)


def build_graph(root: Path = ROOT) -> ImportGraph:
    package = root.name
    modules = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = ImportGraph(modules)

    def owner(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    for mod, path in modules.items():
        internal = graph.internal.setdefault(mod, {})
        external = graph.external.setdefault(mod, {})
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]

        def add(name: str, line: int, mod: str = mod, internal=internal, external=external):
            if name == package or name.startswith(package + "."):
                target = owner(name)
                if target != mod:
                    internal.setdefault(target, line)
            else:
                external.setdefault(name, line)

        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # `from pkg import submodule` imports the submodule; other names come from pkg
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                add(sub if sub in modules else name, node.lineno)
    return graph


def unit(module: str) -> str:
    """The subpackage (or top-level module) a module belongs to."""
    return ".".join(module.split(".")[:2])


def find_cycle(edges: dict[str, Iterable[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None."""
    color: dict[str, int] = {}  # 1: on the stack, 2: done
    for start in sorted(edges):
        if start in color:
            continue
        path = [start]
        iters = [iter(sorted(edges.get(start, ())))]
        color[start] = 1
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                color[path.pop()] = 2
                iters.pop()
            elif color.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in color:
                color[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(edges.get(nxt, ()))))
    return None


def _describe(cycle: list[str], graph: ImportGraph, by_unit: bool) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:], strict=False):
        if by_unit:
            where = next(
                f"{m}:{line} imports {t}"
                for m, ts in sorted(graph.internal.items())
                if unit(m) == a
                for t, line in sorted(ts.items())
                if unit(t) == b
            )
        else:
            where = f"{a}:{graph.internal[a][b]} imports {b}"
        steps.append(where)
    return " -> ".join(cycle) + "\n  " + "\n  ".join(steps)


def _is_vllm(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.")


def reachable_violations(graph: ImportGraph, module: str, forbidden: tuple[str, ...]) -> list[str]:
    """Import chains from ``module`` to a package module under one of ``forbidden`` or, when
    ``forbidden`` names ``"vllm"``, to an import of vLLM (parent packages' ``__init__``
    count: importing a module runs them)."""
    internal = tuple(f for f in forbidden if f != "vllm")
    seen: dict[str, list[str]] = {}
    todo = [(module, [module])]
    while todo:
        mod, chain = todo.pop()
        if mod in seen:
            continue
        seen[mod] = chain
        if internal and mod.startswith(internal):
            continue  # reported; what it imports in turn is its own business
        parents = [".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)]
        for target in [*graph.internal.get(mod, {}), *parents]:
            todo.append((target, [*chain, target]))
    out = []
    for mod, chain in sorted(seen.items()):
        hits = [mod] if internal and mod.startswith(internal) else []
        if "vllm" in forbidden:
            hits += [
                f"{name} (line {line})"
                for name, line in graph.external.get(mod, {}).items()
                if _is_vllm(name)
            ]
        for hit in hits:
            out.append(" -> ".join([*chain[:-1], f"{chain[-1]}: {hit}"]))
    return out


def offline_violations(graph: ImportGraph, module: str) -> list[str]:
    """Import chains from ``module`` to something offline code must not import."""
    return reachable_violations(graph, module, ("vllm", *FORBIDDEN_OFFLINE))


def vllm_importers_outside(graph: ImportGraph, engine: str) -> list[str]:
    """``module:line imports vllm.x`` for every vLLM import outside the package ``engine``."""
    return [
        f"{mod}:{line} imports {name}"
        for mod, names in sorted(graph.external.items())
        if mod != engine and not mod.startswith(engine + ".")
        for name, line in sorted(names.items(), key=lambda kv: kv[1])
        if _is_vllm(name)
    ]


GRAPH = build_graph()


def test_no_module_cycles():
    cycle = find_cycle(GRAPH.internal)
    assert cycle is None, "import cycle between modules: " + _describe(cycle, GRAPH, False)


def test_no_subpackage_cycles():
    edges: dict[str, set[str]] = {}
    for mod, targets in GRAPH.internal.items():
        for target in targets:
            if unit(mod) != unit(target):
                edges.setdefault(unit(mod), set()).add(unit(target))
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle between subpackages: " + _describe(cycle, GRAPH, True)


def test_offline_modules_exist():
    missing = [m for m in OFFLINE if m not in GRAPH.modules]
    assert not missing, f"OFFLINE names modules that are gone: {missing}"


def test_offline_code_imports_no_vllm_and_no_bench():
    bad = [v for m in OFFLINE for v in offline_violations(GRAPH, m)]
    assert not bad, "offline code reaches vLLM, the bench or the engine glue:\n" + "\n".join(bad)


def test_only_the_engine_glue_imports_vllm():
    bad = vllm_importers_outside(GRAPH, ENGINE)
    assert not bad, (
        "only vllm_adaptive.engine imports vLLM; take the name from "
        "vllm_adaptive.engine.vllm_api (add it to its NAMES if it is new):\n  " + "\n  ".join(bad)
    )


def test_algorithms_import_no_glue():
    algorithms = [m for m in GRAPH.modules if m.startswith(ALGORITHMS)]
    assert len(algorithms) > 50, f"few modules under {ALGORITHMS}"
    bad = [v for m in algorithms for v in reachable_violations(GRAPH, m, ("vllm", *GLUE))]
    assert not bad, (
        "an algorithm reaches vLLM or the glue (take what it needs as an argument, or a port "
        "the glue implements):\n" + "\n".join(bad)
    )


def test_engine_glue_imports_no_bench():
    engine = [m for m in GRAPH.modules if m == ENGINE or m.startswith(ENGINE + ".")]
    assert len(engine) > 1, f"no modules under {ENGINE}"
    bad = [v for m in engine for v in reachable_violations(GRAPH, m, ("vllm_adaptive.bench",))]
    assert not bad, "the engine glue reaches the bench:\n" + "\n".join(bad)


# -- the checker itself, on a made-up package -------------------------------------------------


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_lazy_and_relative_cycles(tmp_path):
    root = _fake_package(
        tmp_path,
        {
            "a/__init__.py": "",
            "a/x.py": "def f():\n    from pkg.b import y\n",
            "b/__init__.py": "",
            "b/y.py": "from ..a import x\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a.x\n",
        },
    )
    graph = build_graph(root)
    assert graph.internal["pkg.a.x"] == {"pkg.b.y": 2}
    assert graph.internal["pkg.b.y"] == {"pkg.a.x": 1}
    assert graph.internal["pkg.c"] == {}  # TYPE_CHECKING only
    assert find_cycle(graph.internal) in (
        ["pkg.a.x", "pkg.b.y", "pkg.a.x"],
        ["pkg.b.y", "pkg.a.x", "pkg.b.y"],
    )


def test_checker_follows_offline_chains_through_parents(tmp_path):
    root = _fake_package(
        tmp_path,
        {
            "off.py": "import pkg.mid\n",
            "mid/__init__.py": "from vllm import LLM\n",
            "mid/leaf.py": "",
            "clean.py": "import pkg.mid.leaf as _\n",
        },
    )
    graph = build_graph(root)
    assert offline_violations(graph, "pkg.off") == ["pkg.off -> pkg.mid: vllm (line 1)"]
    assert offline_violations(graph, "pkg.clean") == [
        "pkg.clean -> pkg.mid.leaf -> pkg.mid: vllm (line 1)"
    ]


def test_checker_finds_vllm_outside_the_glue_and_glue_reaching_up(tmp_path):
    root = _fake_package(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/api.py": "import vllm.config\n",
            "engine/glue.py": "from pkg.cfg import X\n",
            "cfg.py": "def f():\n    import pkg.depth.runtime\n",
            "depth/__init__.py": "",
            "depth/runtime.py": (
                "import importlib\n"
                "from pkg.engine import api\n"
                "def g():\n"
                "    importlib.import_module('vllm.forward_context')\n"
                "    __import__('vllm')\n"
            ),
            "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import vllm\n",
        },
    )
    graph = build_graph(root)
    assert vllm_importers_outside(graph, "pkg.engine") == [
        "pkg.depth.runtime:4 imports vllm.forward_context",
        "pkg.depth.runtime:5 imports vllm",
    ]
    assert reachable_violations(graph, "pkg.engine.glue", ("pkg.depth",)) == [
        "pkg.engine.glue -> pkg.cfg -> pkg.depth.runtime: pkg.depth.runtime"
    ]
    assert reachable_violations(graph, "pkg.engine.api", ("pkg.depth",)) == []


def test_only_attention_metadata_touches_the_forward_context() -> None:
    """vLLM's forward context (the step's attention metadata) is read and installed in one
    module; the model classes pass what a mechanism needs down as arguments."""
    names = ("get_forward_context", "set_forward_context", "is_forward_context_available")
    owner = ROOT / "engine" / "attention_metadata.py"
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == owner:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            used = (isinstance(node, ast.Name) and node.id in names) or (
                isinstance(node, ast.Attribute) and node.attr in names
            )
            if isinstance(node, ast.ImportFrom) and node.module == "vllm.forward_context":
                used = True
            if isinstance(node, ast.alias) and node.name in names:
                used = True
            if used:
                bad.append(f"{path.relative_to(ROOT.parent)}:{getattr(node, 'lineno', '?')}")
    assert not bad, "the forward context outside engine/attention_metadata.py:\n  " + "\n  ".join(
        bad
    )
