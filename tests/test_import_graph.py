"""The product's import graph has no cycle: no module of pd_cluster/, connectors/ or kernels/
imports (at its top or inside a function) a module that imports it back, directly or through
others. A registry names the modules it loads by string (importlib), as vLLM's connector
factory does; a constant or helper two modules share lives below both. Imports under
``if TYPE_CHECKING:`` are for annotations only and do not count."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pd_cluster", "connectors", "kernels")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imported(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """Every module name ``tree`` imports, anywhere but under ``if TYPE_CHECKING:``; a
    ``from m import x`` yields ``m`` and ``m.x`` (x may be a submodule)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imported(ast.parse(path.read_text()), name,
                                  path.name == "__init__.py"):
            parts = imported.split(".")
            for i in range(len(parts), 0, -1):  # the longest prefix that is one of ours
                candidate = ".".join(parts[:i])
                if candidate in modules:
                    if candidate != name and not name.startswith(candidate + "."):
                        deps.add(candidate)  # (a package's own __init__ runs first anyway)
                    break
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_finds_a_cycle_through_a_function_level_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    tree = ast.parse("import x\nif TYPE_CHECKING:\n    import y\ndef f():\n    from .z import w\n")
    assert _imported(tree, "p.m", False) == {"x", "p.z", "p.z.w"}


def test_no_import_cycle_in_the_product() -> None:
    graph = import_graph()
    assert len(graph) > 300 and graph["pd_cluster.llm"]  # the tree was read
    assert cycles(graph) == [], "import cycles (break each: see this file's docstring)"
