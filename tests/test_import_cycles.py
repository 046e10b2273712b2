"""No two modules of the package import each other, directly or through others, counting the imports made inside
functions too (a deferred import still ties the two modules together: each needs the other to work, and moving
either import to the top of its file fails at import time)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gacbench"


def _module(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (``from gacbench.x import y`` counts gacbench.x, and
    gacbench.x.y when that is a module)."""
    files = {_module(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {m for m in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if m in files}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

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
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on_stack.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_deferred_cycle(tmp_path):
    pkg = tmp_path / "gacbench"
    (pkg / "llm").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "llm" / "__init__.py").write_text("")
    (pkg / "llm" / "a.py").write_text("from gacbench.llm.b import f\n")
    (pkg / "llm" / "b.py").write_text("def f():\n    from gacbench.llm import a\n")
    (pkg / "llm" / "c.py").write_text("import gacbench.llm.b\n")
    assert cycles(import_graph(pkg)) == [["gacbench.llm.a", "gacbench.llm.b"]]


def test_no_modules_of_the_package_import_each_other():
    assert cycles(import_graph()) == []
