"""The house rules a test can hold: every module within 450 lines (the package and the scripts within 400), no function
over 60 lines but the scripts' main (120), none with more than 5 positional parameters (a signature a library gives
aside), no import circle in the package (counting imports inside functions too: a circle worked around that way is
still one), the pair's diff within its budget."""

import ast
import difflib

import pytest
from helpers import ROOT

pytestmark = pytest.mark.quick
LIMIT, DIFF_BUDGET = 450, 90
PRODUCT_LIMIT, FUNCTION_LIMIT, MAIN_LIMIT, POSITIONAL = 400, 60, 120, 5
# signatures a library gives: autograd Functions' forward, DeepSpeed's allreduce_and_copy (a mend keeps it), torch's
# _load_from_state_dict (quantization's keeping)
LIBRARY_SIGNATURES = {
    ("loss.py", "forward"),
    ("pair_loss.py", "forward"),
    ("mend_speedups.py", "allreduce_and_copy"),
    ("quantization.py", "keeping"),
}


def python_files():
    return [
        p
        for p in ROOT.rglob("*.py")
        if not ({".venv", "out", ".demo", "bench"} & set(p.relative_to(ROOT).parts)) or p.parent.name == "bench"
    ]


def product_files():
    """The package, the scripts at the root and the job's: what a forker reads."""
    return sorted([*(ROOT / "finetune").rglob("*.py"), *ROOT.glob("*.py"), *(ROOT / "job").glob("*.py")])


def test_every_module_is_within_its_size():
    long = {str(p.relative_to(ROOT)): n for p in python_files() if (n := len(p.read_text().splitlines())) > LIMIT}
    assert not long, long
    long = {
        str(p.relative_to(ROOT)): n for p in product_files() if (n := len(p.read_text().splitlines())) > PRODUCT_LIMIT
    }
    assert not long, long


def test_functions_are_short_and_hand_their_values_over_by_name():
    """No function over 60 lines (a script's main: 120), none with more than 5 positional parameters: what follows
    the first few is keyword-only, or goes whole (a piece of the config, the process, a batch)."""
    long, positional = {}, {}
    for path in product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
            limit = MAIN_LIMIT if node.name == "main" and path.parent == ROOT else FUNCTION_LIMIT
            if node.end_lineno - node.lineno + 1 > limit:
                long[where] = node.end_lineno - node.lineno + 1
            names = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls", "ctx")]
            if len(names) > POSITIONAL and (path.name, node.name) not in LIBRARY_SIGNATURES:
                positional[where] = len(names)
    assert not long, long
    assert not positional, positional


def package_imports():
    """{module: the package's modules it imports, anywhere in it}, by dotted name under finetune ("loss",
    "preference" for its __init__, "preference.pair_loss", "internals.hangs")."""
    package = ROOT / "finetune"
    names = {
        ".".join(p.relative_to(package).with_suffix("").parts).removesuffix(".__init__").removesuffix("__init__"): p
        for p in package.rglob("*.py")
    }
    names.pop("", None)  # finetune/__init__.py itself
    graph = {}
    for name, path in names.items():
        here = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # from . import x, from .x import y, from .. import x
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                prefix = [*base, *(node.module.split(".") if node.module else [])]
                found |= {".".join(prefix)} | {".".join([*prefix, a.name]) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("finetune"):
                prefix = node.module.split(".")[1:]
                found |= {".".join(prefix)} | {".".join([*prefix, a.name]) for a in node.names}
        graph[name] = {n for n in found if n in names} - {name}
    return graph


def circle(graph):
    """One import circle as a list of modules, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
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
    lines = [
        [line for line in (ROOT / name).read_text().splitlines() if line.strip()]
        for name in ("single-gpu.py", "zero-optimization.py")
    ]
    diff = difflib.unified_diff(*lines, n=0, lineterm="")
    changed = [d for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    assert len(changed) <= DIFF_BUDGET, len(changed)
