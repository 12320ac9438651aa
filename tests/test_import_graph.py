"""The project's import graph: no circles, and no arrow pointing up the layers.

Every module of the project's packages is parsed with `ast` (nothing is imported). An edge A -> B is any
`import B` / `from B import x` / `from . import x` in A that names a project module, wherever it stands:
at module level, inside a function or method, under `try:`, or under `if TYPE_CHECKING:`: all of them count
(a lazy import is still a dependency, and hiding one in a function is how a circle hides). `from P import x`
is an edge to the submodule `P.x` where there is one, else to `P` (its `__init__`). Not edges: the parent
packages an import runs on the way (`import a.b` runs `a/__init__`; a circle through an `__init__` still shows,
as an edge to the package itself), a module importing itself (`torchengine.tp_runner`'s `__main__` block), and
lookups by a computed name (`importlib.import_module(name)`: `enginecore.runner`'s backend table, checked
below, and `frontend.cli`'s subcommands, which are frontend modules too).

The layers, lowest first; a package imports its own modules and those of lower layers only:

    enginecore                                    pure Python + numpy: no jax, torch, flax, triton
    cpu_kernels, pallas_kernels, triton_kernels   kernel wings, independent of each other
    jaxengine, torchengine                        backends, independent of each other (nor does either
                                                  reach the other's framework through a module it imports)
    frontend
    benchmarks
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = (
    ("enginecore",),
    ("cpu_kernels", "pallas_kernels", "triton_kernels"),
    ("jaxengine", "torchengine"),
    ("frontend",),
    ("benchmarks",),
)
PACKAGES = tuple(p for layer in LAYERS for p in layer)
LAYER_OF = {p: i for i, layer in enumerate(LAYERS) for p in layer}
JAX = ("jax", "jaxlib", "flax", "orbax")
TORCH = ("torch", "triton")
# what a package's modules may not import, nor any project module they import (directly or further down)
FORBIDDEN = {"enginecore": JAX + TORCH, "jaxengine": TORCH, "torchengine": JAX}


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package's __init__)."""
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return mods


MODULES = _modules()


def _imports(name: str, path: Path, is_pkg: bool) -> list[tuple[str, int]]:
    """(absolute dotted name, line) of each name an import statement in the module asks for."""
    package = name if is_pkg else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub if sub in MODULES else mod, node.lineno))
    return out


def _project_module(dotted: str) -> str | None:
    """The project module an imported name lands in (its longest prefix that is one), None outside the project."""
    if dotted.split(".")[0] not in PACKAGES:
        return None
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _graph() -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]], list[str]]:
    """(project edges {A: {B: line}}, third-party imports {A: {top-level name: line}}, imports of project
    modules that do not exist)."""
    edges: dict[str, dict[str, int]] = {}
    external: dict[str, dict[str, int]] = {}
    missing = []
    for name, (path, is_pkg) in MODULES.items():
        mine = edges.setdefault(name, {})
        for dotted, line in _imports(name, path, is_pkg):
            target = _project_module(dotted)
            if dotted.split(".")[0] in PACKAGES:
                if target != dotted:
                    missing.append(f"{name} (line {line}) imports {dotted}, which is not a module of the project")
                if target is not None and target != name:
                    mine.setdefault(target, line)
            else:
                external.setdefault(name, {}).setdefault(dotted.split(".")[0], line)
    return edges, external, missing


EDGES, EXTERNAL, MISSING = _graph()


def _strongly_connected(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    return components


def _cycle_through(start: str, component: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """The shortest circle from `start` back to it inside its component: its modules in order."""
    inside = set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(edges[v]):
            if w not in inside:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is in a component without a circle through it")  # (cannot happen)


def _circles(component: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """The shortest circle through each module of a component (each circle once), as paths with each import's
    line: what to cut."""
    seen, out = set(), []
    for m in component:
        path = _cycle_through(m, component, edges)
        first = path.index(min(path))
        path = path[first:] + path[:first]
        if tuple(path) not in seen:
            seen.add(tuple(path))
            out.append(" -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(path, path[1:] + path[:1]))
                       + f" -> {path[0]}")
    return out


def test_the_graph_sees_every_package_and_resolves_every_import():
    """The scan itself: each package has modules with edges, and every project import names a real module
    (a typo would otherwise drop its edge silently)."""
    for pkg in PACKAGES:
        assert any(m.split(".")[0] == pkg for m in MODULES), f"no modules found for {pkg}"
        assert any(m.split(".")[0] == pkg and EDGES[m] for m in MODULES), f"no imports found in {pkg}"
    assert EDGES["torchengine.runner"].keys() >= {"torchengine.model", "enginecore.config"}
    assert MISSING == []


def test_no_import_circles():
    circles = [f"{', '.join(c)}:" + "".join(f"\n    {p}" for p in _circles(c, EDGES))
               for c in _strongly_connected(EDGES)]
    assert not circles, "import circles among the project's modules:\n" + "\n".join(circles)


def test_no_upward_or_sideways_imports():
    """Each package imports its own modules and lower layers only (enginecore no backend or kernel wing; the
    kernel wings no backend and not frontend; the backends not frontend, nor each other)."""
    bad = []
    for a, targets in sorted(EDGES.items()):
        pa = a.split(".")[0]
        for b, line in sorted(targets.items()):
            pb = b.split(".")[0]
            if pb != pa and LAYER_OF[pb] >= LAYER_OF[pa]:
                bad.append(f"{a} (line {line}) imports {b}: {pb} is not below {pa}")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def _reached_from(package: str) -> dict[str, list[str]]:
    """Every project module the package's modules import, directly or further down: {module: the shortest
    chain of imports from one of the package's modules to it}."""
    chains = {m: [m] for m in sorted(MODULES) if m.split(".")[0] == package}
    queue = deque(chains)
    while queue:
        m = queue.popleft()
        for n in sorted(EDGES[m]):
            if n not in chains:
                chains[n] = chains[m] + [n]
                queue.append(n)
    return chains


def test_no_framework_where_it_does_not_belong():
    """enginecore never imports jax or torch (pure Python + numpy), the jax backend never torch, the torch backend
    never jax: neither in their own modules nor in any module they import (a kernel wing's other binding)."""
    bad = []
    for package, frameworks in FORBIDDEN.items():
        for m, chain in sorted(_reached_from(package).items()):
            for top, line in sorted(EXTERNAL.get(m, {}).items()):
                if top in frameworks:
                    via = "" if len(chain) == 1 else f" (reached by {' -> '.join(chain)})"
                    bad.append(f"{package}: {m} (line {line}) imports {top}{via}")
    assert not bad, "frameworks where they do not belong:\n" + "\n".join(bad)


def test_the_backend_table_names_real_factories():
    """`enginecore.runner` finds the backends by name at run time (not an edge above): each entry must name a
    module of the project and a top-level function or class in it."""
    tree = ast.parse(MODULES["enginecore.runner"][0].read_text())
    table = next(ast.literal_eval(n.value) for n in tree.body
                 if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "_RUNNERS" for t in n.targets))
    assert set(table) == {"jax", "torch"}
    for backend, (module, factory) in table.items():
        assert module in MODULES, f"--backend {backend}: {module} is not a module of the project"
        body = ast.parse(MODULES[module][0].read_text()).body
        names = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert factory in names, f"--backend {backend}: {module} defines no {factory}"
