"""The package's import structure, read from the source with `ast` (nothing is imported):

1. No import cycles in metainfer/: the graph of module-level imports between metainfer modules
   (including the parent packages an import runs) has no cycle. An import inside a function runs
   later and does not count here, but...
2. ...nor may one close a cycle: with deferred (function-level) imports added, the graph is acyclic
   too, except through the edges in DEFERRED_CYCLE_EDGES (each a known circle still to be cut).
3. Layers: metainfer/kernels/ imports, of metainfer, only metainfer.kernels.*, metainfer.settings and
   metainfer.forward_meta (the step layout both the model and the kernels read): nothing of the
   model, the engine, the server or the tools.
4. The rest of the package reaches the kernels through their dispatch module only: outside
   metainfer/kernels/, the one kernel module imported is metainfer.kernels.ops (the model asks no
   kernel module about its internals; ops answers for them).

Imports by name at run time (`importlib.import_module`: the CLI's subcommands, kernels/registry.py's
table) are not seen here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import metainfer

ROOT = Path(metainfer.__file__).parent
PKG = "metainfer"

# Deferred imports that close a circle, as (importer, imported): none may be added. Imports inside
# functions that exist for other reasons (the CLI's fast --help, Triton loaded only with the
# kernels on, optional dependencies) are not listed: they close no circle.
DEFERRED_CYCLE_EDGES: set[tuple[str, str]] = set()

KERNELS = f"{PKG}.kernels"
KERNELS_MAY_IMPORT = {PKG, f"{PKG}.settings", f"{PKG}.forward_meta"}  # (PKG: the package above them)
KERNELS_PUBLIC = {KERNELS, f"{KERNELS}.ops"}


def _in_kernels(name: str) -> bool:
    return name == KERNELS or name.startswith(KERNELS + ".")


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    top: set[str] = field(default_factory=set)  # metainfer modules imported when this one is imported
    deferred: set[str] = field(default_factory=set)  # ... inside its functions


def _modules() -> dict[str, Module]:
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        mods[".".join(parts)] = Module(".".join(parts), path, is_package)
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The metainfer module `name` names (a symbol's name resolves to its module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _with_parents(name: str) -> set[str]:
    """name and the packages above it: importing a.b.c runs a/__init__ and a/b/__init__ first."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & MODULES.keys()


def _targets(node: ast.Import | ast.ImportFrom, mod: Module) -> set[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" for a in node.names]
    out = set()
    for n in names:
        if n == PKG or n.startswith(PKG + "."):
            resolved = _resolve(n)
            if resolved:
                out |= _with_parents(resolved)
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _scan(mod: Module) -> None:
    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (mod.deferred if deferred else mod.top).update(_targets(child, mod) - {mod.name})
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                continue  # never runs
            else:
                visit(child, deferred)

    visit(ast.parse(mod.path.read_text(), str(mod.path)), False)
    mod.deferred -= mod.top


for _m in MODULES.values():
    _scan(_m)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
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
                    out.append(sorted(comp))
    return out


def _describe(comp: list[str], graph: dict[str, set[str]]) -> str:
    inside = set(comp)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & inside))}" for m in comp)


def test_the_scan_sees_the_package():
    assert {"metainfer.kernels.ops", "metainfer.model.layers", "metainfer.engine.runner"} <= MODULES.keys()
    assert "metainfer.kernels.ops" in MODULES["metainfer.model.layers"].top
    assert "metainfer.forward_meta" in MODULES["metainfer.engine.runner"].top


def test_no_module_level_import_cycles():
    graph = {m.name: m.top for m in MODULES.values()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + " | ".join(_describe(c, graph) for c in cycles)


def test_deferred_imports_close_no_cycle():
    graph = {m.name: (m.top | m.deferred) - {t for (s, t) in DEFERRED_CYCLE_EDGES if s == m.name}
             for m in MODULES.values()}
    cycles = _cycles(graph)
    assert not cycles, ("a function-level import closes an import circle (move what both need to one side): "
                        + " | ".join(_describe(c, graph) for c in cycles))


def test_kernels_import_nothing_above_them():
    bad = {
        m.name: sorted(t for t in m.top | m.deferred if not (_in_kernels(t) or t in KERNELS_MAY_IMPORT))
        for m in MODULES.values() if _in_kernels(m.name)
    }
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"kernel modules importing the layers above them: {bad}"


def test_the_rest_reaches_the_kernels_through_ops_only():
    bad = {
        m.name: sorted(t for t in m.top | m.deferred if _in_kernels(t) and t not in KERNELS_PUBLIC)
        for m in MODULES.values() if not _in_kernels(m.name)
    }
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"modules importing kernel internals (ask through metainfer.kernels.ops): {bad}"
