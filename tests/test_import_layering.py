"""The library's import structure: no static import cycle inside ``hybridgen/``, and the library
never imports its clients (``hybridgen_harness``, ``experiments``, ``benchmarks``, ``baselines``).

The import graph is read from the source (ast), not by importing: an edge A -> B for every
``import B`` / ``from B import x`` that A runs when it is imported, i.e. at module level,
including inside ``if`` / ``try`` / ``with`` blocks but not under ``if TYPE_CHECKING:`` and not
inside functions or classes' methods. Importing ``a.b.c`` runs ``a/__init__.py`` and
``a/b/__init__.py`` first, so an edge also goes to every package above the imported module
(except the importer's own packages, which are already being imported when it runs): a cycle
through a package's ``__init__`` is as real as a direct one.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Iterator, List, Set

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = ("hybridgen_harness", "experiments", "benchmarks", "baselines")


# ------------------------------------------------------------------ the graph, from the source
def modules_of(package_dir: Path) -> Dict[str, Path]:
    """Dotted module name -> file, for every .py file under ``package_dir`` (a package)."""
    base = package_dir.parent
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def import_nodes(tree: ast.AST, module_level: bool = True) -> Iterator[ast.AST]:
    """The import statements a module runs: at module level (default), or anywhere (also inside
    functions); never those under ``if TYPE_CHECKING:`` (its ``else`` branch does run)."""
    def walk(body) -> Iterator[ast.AST]:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, ast.If) and _is_type_checking(node):
                yield from walk(node.orelse)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                if not module_level:
                    yield from walk(ast.iter_child_nodes(node))
            else:
                yield from walk(ast.iter_child_nodes(node))
    yield from walk(tree.body)


def imported_names(module: str, is_package: bool, node: ast.AST, known=()) -> List[str]:
    """The dotted names an import statement of ``module`` imports: ``from p import x`` imports
    the module ``p.x`` when ``known`` has it, else it reads the attribute x of ``p`` (imports p)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        src = ".".join(base + ([node.module] if node.module else []))
    else:
        src = node.module or ""
    subs = [f"{src}.{a.name}" for a in node.names]
    return [s for s in subs if s in known] + ([src] if any(s not in known for s in subs) else [])


def import_graph(package_dir: Path, module_level: bool = True) -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports (and, through them, the packages above them)."""
    mods = modules_of(package_dir)
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in import_nodes(tree, module_level):
            for name in imported_names(mod, path.name == "__init__.py", node, mods):
                if name not in mods:
                    continue
                parts = name.split(".")
                for i in range(1, len(parts) + 1):
                    target = ".".join(parts[:i])
                    own_package = mod.startswith(target + ".") and i < len(parts) or target == mod
                    if target in mods and not own_package:
                        graph[mod].add(target)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def _describe(graph: Dict[str, Set[str]], comp: List[str]) -> str:
    inside = set(comp)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & inside))}" for m in comp)


# ------------------------------------------------------------------ the finder can fail
def _write(root: Path, files: Dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_finder_sees_direct_package_init_and_hidden_cycles_but_not_type_checking_ones(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        # a direct cycle a <-> b
        "pkg/a.py": "from pkg.b import x\n",
        "pkg/b.py": "import os\nfrom pkg import a\nx = 1\n",
        # a cycle through a package __init__: sub/__init__ imports sub.c, c imports d, d imports sub.e
        "pkg/sub/__init__.py": "from pkg.sub.c import y\n",
        "pkg/sub/c.py": "from pkg.d import z\ny = 1\n",
        "pkg/d.py": "try:\n    from pkg.sub.e import w\nexcept ImportError:\n    w = None\nz = 1\n",
        "pkg/sub/e.py": "w = 1\n",
        # one-way at run time: f -> g, g -> f only for type checkers or inside a function
        "pkg/f.py": "from pkg.g import v\n",
        "pkg/g.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.f import t\n"
                     "def later():\n    from pkg import f\nv = 1\n"),
        # a module importing its own package is no cycle (the package is importing it already)
        "pkg/own/__init__.py": "from pkg.own.h import u\n",
        "pkg/own/h.py": "import pkg.own.i\nu = 1\n",
        "pkg/own/i.py": "",
    })
    graph = import_graph(tmp_path / "pkg")
    found = cycles(graph)
    assert ["pkg.a", "pkg.b"] in found
    assert ["pkg.d", "pkg.sub", "pkg.sub.c"] in found, found
    assert len(found) == 2, found
    # counting imports inside functions too, the hidden f <-> g cycle appears
    assert ["pkg.f", "pkg.g"] in cycles(import_graph(tmp_path / "pkg", module_level=False))


# ------------------------------------------------------------------ the library
def test_no_static_import_cycle_in_the_library():
    graph = import_graph(ROOT / "hybridgen")
    assert len(graph) > 50 and "hybridgen.methods.protocol" in graph
    found = cycles(graph)
    assert not found, "import cycles (module-level imports): " + " | ".join(_describe(graph, c) for c in found)


def test_the_library_never_imports_its_clients():
    """Not even inside a function: the harness, experiments, benchmarks and baselines use the
    library, never the reverse (a method package is found through its entry point)."""
    bad = []
    for mod, path in modules_of(ROOT / "hybridgen").items():
        for node in import_nodes(ast.parse(path.read_text()), module_level=False):
            for name in imported_names(mod, path.name == "__init__.py", node):
                if name.split(".")[0] in CLIENTS:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_packages_import_in_a_fresh_interpreter():
    """Each in its own process, in this order and alone: a cycle hidden by import order shows here."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for code in ("import hybridgen, hybridgen.methods, hybridgen.perf",
                 "import hybridgen.perf", "import hybridgen.methods.footprint", "import hybridgen.model.spec",
                 "import hybridgen.perf.context", "import hybridgen_harness.results"):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                             timeout=300)
        assert res.returncode == 0, f"{code}: {res.stderr.strip().splitlines()[-1:]}"
