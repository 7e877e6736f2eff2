"""The house rules a test can hold: every module within 450 lines, no import circle in the package (counting imports
inside functions too: a circle worked around that way is still one), the pair's diff within its budget."""
import ast
import difflib

import pytest

from helpers import ROOT

pytestmark = pytest.mark.quick
LIMIT, DIFF_BUDGET = 450, 90


def python_files():
    return [p for p in ROOT.rglob("*.py") if not ({".venv", "out", ".demo", "bench"} & set(p.relative_to(ROOT).parts))
            or p.parent.name == "bench"]


def test_every_module_is_within_its_size():
    long = {str(p.relative_to(ROOT)): n for p in python_files() if (n := len(p.read_text().splitlines())) > LIMIT}
    assert not long, long


def package_imports():
    """{module: the package's modules it imports, anywhere in it} (finetune's and finetune.internals', by name)."""
    modules = {p.stem: p for p in (ROOT / "finetune").rglob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # from . import x, from .x import y, from .. import x
                names |= {node.module.split(".")[-1]} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("finetune"):
                names |= {node.module.split(".")[-1]} if "." in node.module else {a.name for a in node.names}
        graph[name] = {n for n in names if n in modules} - {name}
    return graph


def circle(graph):
    """One import circle as a list of modules, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None
    return next((found for node in sorted(graph) if node not in state and (found := visit(node, [node]))), None)


def test_the_package_has_no_import_circle():
    graph = package_imports()
    assert graph["base"] == set()  # below them all
    assert circle(graph) is None, " -> ".join(circle(graph))
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check finds one


def test_the_pair_differs_by_what_zero_changes_only():
    """`diff single-gpu.py zero-optimization.py`, blank lines aside, within its budget of changed lines."""
    lines = [[line for line in (ROOT / name).read_text().splitlines() if line.strip()]
             for name in ("single-gpu.py", "zero-optimization.py")]
    diff = difflib.unified_diff(*lines, n=0, lineterm="")
    changed = [d for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    assert len(changed) <= DIFF_BUDGET, len(changed)
