"""The house's floors, checked by walking every import with `ast` (docs/DESIGN.md, "Dependency direction").

    hgc/                 the command line, the roof: may import anything below
    runtime/             its rooms, each importing only the rooms below it:
        server/          the HTTP server
        core/            the engine core's process, its messages, the server's client of it
        assembly.py      artifact -> memory plan -> pools -> backends -> runners -> engine
        dist/            tensor-parallel ranks
        engine/          requests, scheduling, sampling, the speculative round, the loop
        artifact/        loading an artifact: docs, checked programs, weights, binding, bundle
        graphs/          the graph runner, buckets, staging, CUDA graphs, start-up parity
        backends/        the backend classes, over backends/kernels/ (Triton kernels)
        cache/           KV pages, state slots, snapshots, the prefix cache, the memory plan
        step/            the per-step context, the bound op table, host-to-device copies
    models/  compiler/   side by side with the runtime: each imports the ground floor and itself
    compiler/splitops    the ground floor: imports only itself
    testkit/             toy models and checks that tests and benchmarks share: imports the product

Every import counts, at module level or inside a function (a lazy import is a dependency that
runs later). `from a.b import c` is an edge to the module a.b.c when that is a module of the repo,
else to a.b. The tests fail on a circle (naming it) and on an edge between floors that must not
meet (naming the file and line).

The lab stands beside the house: benchmarks/ imports the product and testkit/, never tests/, and its
scripts import each other by file name (each puts benchmarks/ or its own folder on sys.path), so the
circle check resolves such a name to the benchmark file of that name.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("hgc", "compiler", "models", "runtime", "testkit")

# The runtime's rooms, lowest first: each may import itself and the rooms before it.
RUNTIME_ROOMS = ("step", "cache", "backends.kernels", "backends", "graphs", "artifact", "engine", "dist",
                 "assembly", "core", "server")
PRODUCT = {"splitops", "models", "compiler", *(f"runtime.{r}" for r in RUNTIME_ROOMS), "hgc"}

# floor -> the floors it may import
ALLOWED = {
    "splitops": {"splitops"},
    "models": {"splitops", "models"},
    "compiler": {"splitops", "compiler"},
    **{f"runtime.{room}": {"splitops", *(f"runtime.{r}" for r in RUNTIME_ROOMS[: i + 1])}
       for i, room in enumerate(RUNTIME_ROOMS)},
    "runtime": set(),  # a runtime module outside every room may not import anything of ours
    "hgc": PRODUCT,
    "testkit": PRODUCT | {"testkit"},
}


def floor(module: str) -> str:
    if module == "compiler.splitops" or module.startswith("compiler.splitops."):
        return "splitops"
    if module.startswith("runtime."):
        for room in sorted(RUNTIME_ROOMS, key=len, reverse=True):
            if module == f"runtime.{room}" or module.startswith(f"runtime.{room}."):
                return f"runtime.{room}"
    return module.split(".", 1)[0]


def find_modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported repo module, line) for every import statement of the file, nested ones included."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else target, node.lineno))
    out = []
    for name, line in found:
        # `import a.b.c` of a repo module, or the nearest enclosing repo module of a dotted name
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append((name, line))
    return out


def import_graph(root: Path = REPO, packages=PACKAGES) -> dict[str, list[tuple[str, int]]]:
    known = find_modules(root, packages)
    return {m: imports_of(m, p, known) for m, p in known.items()}


def benchmark_modules(root: Path = REPO) -> dict[str, Path]:
    """Every file under benchmarks/ by the name a script imports it under: its file name."""
    out: dict[str, Path] = {}
    for path in sorted((root / "benchmarks").rglob("*.py")):
        assert path.stem not in out, f"{path.relative_to(root)}: a second benchmark file named {path.stem}.py " \
                                     f"(first: {out[path.stem].relative_to(root)}); `import {path.stem}` would be either"
        out[path.stem] = path
    return out


def lab_graph(root: Path = REPO) -> dict[str, list[tuple[str, int]]]:
    """The import graph of the product, testkit and the benchmark scripts together."""
    known = {**find_modules(root), **benchmark_modules(root)}
    return {m: imports_of(m, p, known) for m, p in known.items()}


def imports_of_tests(root: Path = REPO) -> list[str]:
    """file:line of every import of the tests package under benchmarks/."""
    bad = []
    for path in sorted((root / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n == "tests" or n.startswith("tests.") for n in names):
                bad.append(f"{path.relative_to(root)}:{node.lineno}")
    return bad


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _ in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def floor_violations(graph, root: Path = REPO) -> list[str]:
    known = find_modules(root)
    bad = []
    for module, edges in graph.items():
        for target, line in edges:
            if floor(target) not in ALLOWED[floor(module)]:
                where = known.get(module, module)
                bad.append(f"{Path(where).relative_to(root) if isinstance(where, Path) else where}:{line}: "
                           f"{module} ({floor(module)}) imports {target} ({floor(target)})")
    return bad


def test_no_import_circles():
    found = cycles(lab_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def package_graph(graph) -> dict[str, list[tuple[str, int]]]:
    """The import graph between the subfolders of a floor (compiler/passes, compiler/lints,
    runtime/backends, ...), without a folder's edges to itself: two folders that import each other
    are one tangle even when no two of their modules do. A floor's own top-level modules (runtime/
    engine.py, compiler/pipeline.py) are where its subfolders meet, so they are left out."""
    known = set(graph)

    def folder(module):
        name = module if any(m.startswith(module + ".") for m in known) else module.rpartition(".")[0]
        return name if "." in name else None  # None: a floor's top level

    out: dict[str, list[tuple[str, int]]] = {}
    for module, edges in graph.items():
        src = folder(module)
        if src is None:
            continue
        out.setdefault(src, [])
        out[src] += [(folder(t), line) for t, line in edges if folder(t) not in (None, src)]
    return out


def test_no_circles_between_folders():
    found = cycles(package_graph(import_graph()))
    assert not found, "folders importing each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_each_floor_imports_only_the_floors_below_it():
    bad = floor_violations(import_graph())
    assert not bad, "imports across floors:\n  " + "\n  ".join(bad)


def test_the_walk_sees_circles_lazy_imports_and_relative_imports(tmp_path):
    """The checker itself: a circle through a function-level import, and a compiler pass importing
    the runtime through a relative import, and the runtime's lowest room importing a higher module, in a
    throwaway tree."""
    files = {
        "compiler/__init__.py": "",
        "compiler/passes/__init__.py": "",
        "compiler/passes/a.py": "def f():\n    from compiler.passes import b\n",
        "compiler/passes/b.py": "from . import a\nfrom ...runtime import engine\n",
        "runtime/__init__.py": "",
        "runtime/engine.py": "import torch\n",
        "runtime/step/__init__.py": "",
        "runtime/step/context.py": "from runtime.engine import torch\n",
        "models/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["compiler.passes.a", "compiler.passes.b"]]
    assert cycles(package_graph(graph)) == []  # within one folder
    assert floor_violations(graph, tmp_path) == [
        "compiler/passes/b.py:2: compiler.passes.b (compiler) imports runtime.engine (runtime.engine)",
        "runtime/step/context.py:1: runtime.step.context (runtime.step) imports runtime.engine (runtime.engine)"]


def test_no_benchmark_imports_tests():
    bad = imports_of_tests()
    assert not bad, "benchmarks importing tests/ (shared code goes in testkit/):\n  " + "\n  ".join(bad)


def test_the_lab_walk_sees_circles_between_scripts_and_imports_of_tests(tmp_path):
    """The checker on a throwaway lab: two scripts in different folders importing each other by
    file name (one lazily), and a probe importing a test module."""
    files = {
        "testkit/__init__.py": "",
        "benchmarks/common.py": "import torch\n",
        "benchmarks/kernels/a.py": "import common\nfrom b import f\n",
        "benchmarks/serving/b.py": "def f():\n    import a\n",
        "benchmarks/probes/c.py": "import common\n\ndef g():\n    from tests.gpu.test_x import check\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cycles(lab_graph(tmp_path)) == [["a", "b"]]
    assert imports_of_tests(tmp_path) == ["benchmarks/probes/c.py:4"]


def test_the_runtime_is_its_rooms_and_its_entry_modules():
    """Every module of the runtime lives in a room; beside them only the package and its entry modules."""
    rooms = {r.split(".")[0] for r in RUNTIME_ROOMS if r != "assembly"}
    top = {p.name for p in (REPO / "runtime").iterdir() if p.name != "__pycache__"}
    assert top - {f"{r}" for r in rooms} == {"__init__.py", "assembly.py"}
