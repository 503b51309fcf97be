"""The code's shape, checked so it cannot drift back: no import circle between the product's
modules (lazy imports inside functions count: a circle dodged by a late import is still a
circle), no module of the serving wing over 600 lines, no function over 80 lines and no
class over 350 (docstrings included), and a batch scheduler that drives
:class:`~specrt.runtime.generation.Generation` instead of copying the decode loop's
prefill, length, commit or result logic.

Pure source analysis (``ast``): no model is loaded.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"specrt": ROOT / "specrt_ns", "specrt.runtime": ROOT / "runtime", "specrt.export": ROOT / "export"}
MAX_FUNCTION, MAX_CLASS, MAX_SERVE_FILE = 80, 350, 600


def _modules() -> dict[str, Path]:
    """Import name -> file of every product module (pyproject's package-dir mapping)."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            if "__pycache__" in f.parts:
                continue
            rel = f.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """Product modules ``name`` imports anywhere in its file (``if TYPE_CHECKING`` blocks left out)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)  # "from .pkg import module"
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def _import_graph() -> dict[str, set[str]]:
    mods = _modules()
    # a package's __init__ importing its own submodules is not a circle with them
    return {n: {m for m in _imports(n, p, mods) if not (p.name == "__init__.py" and m.startswith(n + "."))} for n, p in mods.items()}


def test_cycle_finder_finds_a_circle():
    # the checker itself: a -> b -> c -> a is one circle, d alone none
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    graph = _import_graph()
    assert "specrt.runtime.serve.jobs" in graph["specrt.runtime.serve.batching"]  # the graph sees relative imports
    assert _cycles(graph) == []


def test_serving_modules_are_short():
    long = {p.name: n for p in (ROOT / "runtime" / "serve").glob("*.py") if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_SERVE_FILE}
    assert long == {}


def _sizes():
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield path.relative_to(ROOT), node, node.end_lineno - node.lineno + 1


def test_functions_and_classes_are_short():
    too_long = [
        f"{path}:{node.lineno} {node.name} ({n} lines)" for path, node, n in _sizes() if n > (MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION)
    ]
    assert too_long == []


@pytest.mark.parametrize(
    "name", ["prefill", "feed", "chunk_bounds", "one_round", "length_finish", "commit", "CompletionText", "Stats", "GenerationResult", "LogprobRecorder"]
)
def test_batch_scheduler_copies_no_decode_logic(name):
    """The scheduler names none of the decode loop's pieces (it steps Generation objects:
    ``row.gen.prefill(...)`` is the generation's method, not the loop's function)."""
    tree = ast.parse((ROOT / "runtime" / "serve" / "batching.py").read_text(encoding="utf-8"))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert name not in used
