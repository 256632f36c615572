"""The layout's import rules (docs/architecture.md), read from the code with ast; nothing is imported.

- ``ext_proc`` imports nothing of ``xds_server``, ``inferlb``, ``sim`` or ``bench``;
- ``xds_server`` imports nothing of ``ext_proc``, ``inferlb``, ``sim`` or ``bench``;
- ``sim`` imports neither library (nor ``inferlb`` or ``bench``);
- no import cycle among the modules of the packages (function-level imports count; only those
  under ``if TYPE_CHECKING:`` don't).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("inferlb", "xds_server", "ext_proc", "sim", "bench", "protos")
FORBIDDEN = {
    "ext_proc": {"xds_server", "inferlb", "sim", "bench"},
    "xds_server": {"ext_proc", "inferlb", "sim", "bench"},
    "sim": {"xds_server", "ext_proc", "inferlb", "bench"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded |= {id(n) for n in ast.walk(node)}
    return guarded


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import of ``module`` (names resolved to submodules)."""
    tree = ast.parse(path.read_text(), str(path))
    guarded = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if path.name == "__init__.py" else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            found.append((base, node.lineno))
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names if f"{base}.{a.name}" in MODULES]
    return found


def test_the_libraries_and_the_simulator_stay_apart():
    broken = []
    for module, path in MODULES.items():
        top = module.split(".")[0]
        for name, line in _imports(module, path):
            if name.split(".")[0] in FORBIDDEN.get(top, ()):
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert broken == []


def test_no_import_cycle():
    graph = {m: {n for n, _ in _imports(m, p) if n in MODULES and n != m} for m, p in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_rules_see_a_planted_violation(tmp_path):
    """The checker itself: an xds_server module that imports ext_proc is reported."""
    path = tmp_path / "bad.py"
    path.write_text("from ext_proc.picker import pick\n")
    assert ("ext_proc.picker", 1) in _imports("xds_server.bad", path)
