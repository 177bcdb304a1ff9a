"""The import graph of the two packages has no circle, counting every import statement (lazy and type-only too)."""

import ast
import pathlib

import chatenv
import wrappers

ROOTS = [pathlib.Path(chatenv.__file__).parent, pathlib.Path(wrappers.__file__).parent]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for root in ROOTS:
        for path in root.rglob("*.py"):
            parts = path.relative_to(root.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(node: ast.AST, name: str, is_package: bool, known: set[str]) -> list[str]:
    """The project modules one import statement loads (``from pkg import mod`` names ``pkg.mod``)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = name if is_package else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = f"{base}.{node.module}" if node.module else base
        else:
            module = node.module or ""
        targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module for alias in node.names]
    else:
        return []
    out = []
    for target in targets:
        while target and target not in known:  # `import a.b.c` loads a.b.c; a name inside a module: the module
            target = target.rpartition(".")[0]
        if target:
            out.append(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _imported(node, name, is_package, known):
                # a module reading its own package's __init__ (or a parent's) is how packages work, not a circle
                if target != name and not name.startswith(target + "."):
                    edges.add(target)
        graph[name] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circle():
    graph = _graph()
    assert "chatenv.envs.state" in graph and "chatenv.tasks.registry" in graph["chatenv.envs"]  # the scan sees
    assert _circles(graph) == []


def test_a_circle_would_be_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


TOP = ("chatenv.cli", "chatenv.serve", "chatenv.distributed", "chatenv.integrations", "chatenv.envserver")


def test_lower_layers_never_import_the_top_ones():
    """The CLI, the endpoint, Ray collection and the integrations sit on the core; nothing below imports them."""
    graph = _graph()
    upward = [
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name.startswith("chatenv") and not name.startswith(TOP)
        for target in targets
        if target.startswith(TOP)
    ]
    assert upward == []
