"""The package's shape: modules a reader can hold in mind, imports that run one way.

* no module of ``jaxgrad/`` is longer than 700 lines;
* the modules import each other without a cycle (a package ``__init__`` re-exporting its submodules is not one);
* a model family (``kan``, ``cnn``, ``lora``) imports no other family, and the shared layers (``ops``, ``verify``,
  ``train``, ``checks``) import no family: only the tools above them (``bench``, ``demo``, ``cli``) and the
  family's own training task may;
* the families hold model code only: no benchmark harness or PyTorch peer lives in them.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxgrad"
FAMILIES = ("kan", "cnn", "lora")
SHARED = ("ops", "verify", "train", "checks")
MAX_LINES = 700


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (``from pkg import sub`` counts as an import of ``pkg.sub`` only)."""
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [module, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                # a submodule importing its own package's __init__ is how Python loads it, not a dependency
                if target in mods and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_module_is_longer_than_700_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules along their concepts: {long}"


def test_modules_import_each_other_without_a_cycle():
    assert import_cycles(import_graph(_modules())) == []


def test_a_cycle_is_found_where_there_is_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("layer", FAMILIES + SHARED)
def test_families_and_shared_layers_import_no_other_family(layer):
    graph = import_graph(_modules())
    crossing = sorted((a, b) for a, targets in graph.items() if _layer(a) == layer
                      for b in targets if _layer(b) in FAMILIES and _layer(b) != layer)
    assert crossing == []


@pytest.mark.parametrize("family", FAMILIES)
def test_families_hold_model_code_only(family):
    """Benchmark suites, their harness and the PyTorch peers live in ``jaxgrad.bench``."""
    bench_like = sorted(p.name for p in (ROOT / family).glob("*.py")
                        if p.stem.startswith("bench") or "import torch" in p.read_text())
    assert bench_like == []
