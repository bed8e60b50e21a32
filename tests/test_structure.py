"""The code's shape, checked: no import circles between the modules of epic_rag and the demo app (none direct,
none around a loop), and no source file over 600 lines outside the tests and the benchmark harnesses.

Imports are read with `ast` (nothing is imported), every `import` and `from ... import` counted wherever it
stands, inside functions too: a function-level import is still a dependency, only a later one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# module prefix -> its folder (the demo's source lives in apps/demo and installs as epic_rag_demo)
PACKAGES = {"epic_rag": ROOT / "epic_rag", "epic_rag_demo": ROOT / "apps" / "demo"}
MAX_LINES = 600
# Harnesses that measure the code rather than serve it: their size follows what they measure.
HARNESSES = (ROOT / "epic_rag" / "bench",)


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [pkg, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]) -> list[str]:
    """The modules an import statement in module `name` names: `from p import m` names the submodule p.m where
    there is one, else p itself (a name defined in p's __init__)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    base = base.replace("apps.demo", "epic_rag_demo", 1)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of these packages it imports (a package's own __init__ counts when named)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(name, path, node, mods):
                if target in mods and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_read_whole_including_function_level_imports():
    graph = import_graph()
    assert len(graph) > 90  # every module of both packages
    assert "epic_rag.engine.vllm_api" in graph["epic_rag.engine.engine"]
    assert "epic_rag.bench.report" in graph["epic_rag.bench.accuracy"]  # imported inside a function
    assert "epic_rag_demo.state" in graph["epic_rag_demo.server"]  # the demo, under its installed name


def test_the_cycle_finder_finds_a_direct_and_a_three_module_circle():
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_another_that_imports_it_back_directly_or_around_a_loop():
    assert circles(import_graph()) == []


def test_vllm_api_imports_no_other_engine_module():
    # the one place for vLLM's internals stays a leaf: the linker, stage and layout build on it, never back
    engine_deps = {d for d in import_graph()["epic_rag.engine.vllm_api"] if d.startswith("epic_rag.engine")}
    assert engine_deps == set()


def test_no_source_file_is_over_600_lines_outside_the_tests_and_the_harnesses():
    sources = [p for d in ("epic_rag", "apps", "examples", "scripts") for p in ROOT.glob(f"{d}/**/*.py")]
    assert len(sources) > 90
    long = {
        str(p.relative_to(ROOT)): n
        for p in sources
        if not any(p.is_relative_to(h) for h in HARNESSES) and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
