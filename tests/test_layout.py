"""The package layout (DESIGN.md, "Layers"): no import circle anywhere, no library module importing
the tools, and no inner layer importing an outer one.

Reads every module's source with ``ast`` (nothing is imported), so it sees every static import:
module level, inside functions and under ``TYPE_CHECKING`` alike. A lazy import inside a function
still makes a circle of modules that lean on each other, so it counts.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Optional, Set

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "numbakv"

#: DESIGN.md's layer table, inner to outer: a module may import modules of its own layer or of
#: an inner one, never of an outer one. Keys are module names relative to ``numbakv``; a name
#: ending in ``.`` stands for a whole sub-package (``prefix.`` and ``dist.`` may not exist yet).
LAYERS: List[List[str]] = [
    # the platform (DESIGN.md's first row; _compile_notice is the one-line "compiling" notice)
    ["errors", "config", "_jit", "_memory", "_dlpack", "_gpu_probe", "device", "_guard",
     "_compile_notice"],
    ["_inputs"],
    ["cells"],
    ["kernels."],
    ["storage", "pages", "rotation"],
    ["state."],
    ["causal", "streams", "wrappers", "simple", "recurrent", "hybrid", "paired", "step"],
    ["attention", "prompt", "hf."],
    ["prefix."],
    ["dist."],
    # the package facade: imports the public classes, never the tools nor dist/
    ["__init__"],
    ["tools.", "__main__"],
]

#: "knows nothing of" entries of the table that are inner layers (the order alone allows them)
FORBIDDEN_INNER: Dict[str, List[str]] = {
    "kernels.": ["cells"],
    "storage": ["cells"],
    "prefix.": ["kernels.", "storage", "pages", "cells"],
}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> Dict[str, pathlib.Path]:
    """Every module of the package: ``{name relative to numbakv: path}`` (``__init__`` is the
    package itself, ``kernels`` the kernels package's ``__init__.py``)."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))
            if "__pycache__" not in p.parts}


def _is_package(name: str, modules: Dict[str, pathlib.Path]) -> bool:
    return name == "__init__" or modules[name].name == "__init__.py"


def _resolve(name: str, level: int, importer: str, modules: Dict[str, pathlib.Path]) -> Optional[str]:
    """The numbakv module (relative name; ``__init__`` for the package root) that an import
    names, or None when it is outside numbakv."""
    if level == 0:
        if name != "numbakv" and not name.startswith("numbakv."):
            return None
        rel = name[len("numbakv."):] if name != "numbakv" else ""
    else:
        base = importer.split(".") if importer != "__init__" else []
        if not _is_package(importer, modules):
            base = base[:-1]
        base = base[:len(base) - (level - 1)] if level > 1 else base
        rel = ".".join(base + ([name] if name else []))
    return rel or "__init__"


def _imports(importer: str, modules: Dict[str, pathlib.Path]) -> Set[str]:
    """The numbakv modules ``importer`` imports anywhere in its source."""
    tree = ast.parse(modules[importer].read_text(), str(modules[importer]))
    found: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, 0, importer, modules)
                if target is not None:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node.module or "", node.level, importer, modules)
            if target is None:
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = alias.name if target == "__init__" else f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    found.discard(importer)
    return found


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    return {name: _imports(name, modules) for name in modules}


def _layer_of(name: str) -> Optional[int]:
    for i, layer in enumerate(LAYERS):
        for entry in layer:
            if name == entry or (entry.endswith(".") and (name + ".").startswith(entry)):
                return i
    return None


def _matches(name: str, entry: str) -> bool:
    return name == entry or (entry.endswith(".") and (name + ".").startswith(entry))


GRAPH = _graph()


def test_the_walk_sees_the_imports():
    """The walker resolves relative, absolute, package and function-level imports (else the
    checks below would pass on an empty graph)."""
    assert {"causal", "cells", "storage", "_inputs"} <= GRAPH["streams"] | GRAPH["causal"]
    assert "kernels.launch" in GRAPH["kernels.put"]
    assert "state" in GRAPH["simple"]               # `from . import state` inside a method
    assert "state.methods" in GRAPH["causal"]       # `from .state.methods import StateMethods`
    assert "tools.demo" in GRAPH["tools.cli"]       # `from . import demo` inside a function
    assert "tools.cli" in GRAPH["__main__"]


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in GRAPH if _layer_of(name) is None)
    assert not unplaced, (f"modules {unplaced} are in no layer of DESIGN.md's table: add them "
                          "to the table and to LAYERS in tests/test_layout.py")


def test_no_import_circle():
    """Tarjan's strongly connected components: any component of more than one module is a
    circle (the message shows one way around it)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    circles: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in GRAPH:
                continue
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
                circles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, "import circles (modules that import each other, directly or not): " + \
        "; ".join(" <-> ".join(c) for c in circles)


def test_the_library_never_imports_the_tools():
    bad = sorted(f"{m} imports {t}" for m, targets in GRAPH.items()
                 if not _matches(m, "tools.") and m != "__main__"
                 for t in targets if _matches(t, "tools."))
    assert not bad, bad


def test_no_inner_layer_imports_an_outer_one():
    bad = []
    for m, targets in GRAPH.items():
        lm = _layer_of(m)
        for t in targets:
            lt = _layer_of(t)
            if lm is not None and lt is not None and lt > lm:
                bad.append(f"{m} (layer {lm}) imports {t} (layer {lt})")
            for entry, forbidden in FORBIDDEN_INNER.items():
                if _matches(m, entry) and any(_matches(t, f) for f in forbidden):
                    bad.append(f"{m} imports {t}, which DESIGN.md says it knows nothing of")
    assert not bad, "\n".join(sorted(bad))


def test_dist_is_never_imported_by_the_package_root():
    assert not any(_matches(t, "dist.") for t in GRAPH["__init__"])


@pytest.mark.parametrize("importer, imported, expected", [
    ("causal", ("kernels", 1, "launch"), "kernels.launch"),
    ("kernels.put", ("", 1, "launch"), "kernels.launch"),
    ("kernels.put", ("", 2, "_jit"), "_jit"),
    ("state.files", ("codec", 1, None), "state.codec"),
    ("tools.cli", ("numbakv", 0, "_jit"), "_jit"),
])
def test_resolve(importer, imported, expected):
    """Relative imports resolve the way Python resolves them."""
    modules = _modules()
    name, level, member = imported
    target = _resolve(name, level, importer, modules)
    if member is not None:
        sub = member if target == "__init__" else f"{target}.{member}"
        target = sub if sub in modules else target
    assert target == expected
