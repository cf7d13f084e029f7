"""Nothing in the course is patched at run time: what a reader sees called is what runs.

Read statically (ast) over every .py file of the course outside tests/: no `mock` (unittest.mock, pytest's
monkeypatch) imported, no `setattr` on an imported module, and no assignment to (or deletion of) an attribute
of an imported module. A module that must behave differently is handed what differs (a span, a recorder, a
callback) or offers a function that changes its own state (common/comm.time_all_to_alls); a test may patch.
"""
import ast
import functools
import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"tests", "runs", "__pycache__"}          # (and every hidden folder: .venv, .git)


def course_files() -> list[Path]:
    """Every .py file of the course outside tests/: the chapters, common/, the notebooks' sources."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith(".")]
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found)


@functools.cache
def _is_module(name: str) -> bool:
    """`name` (dotted) is a module: a file or package of the course, or of an installed package (looked up
    on disk, nothing imported)."""
    top, *rest = name.split(".")
    for base in [ROOT / top] + _installed(top):
        path = base.joinpath(*rest)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or (not rest and base.is_file()):
            return True
    return False


@functools.cache
def _installed(top: str) -> list[Path]:
    """Where the installed package or module `top` lives (its folder, or its file), without importing it."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [Path(p) for p in spec.submodule_search_locations]
    return [Path(spec.origin)] if spec.origin and spec.origin not in ("built-in", "frozen") else [Path(top)]


def module_names(tree: ast.AST, package: str) -> set[str]:
    """The names a file binds to modules: `import x [as y]`, `from p import m` (m a module), and
    `y = import_module("x")`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                          # relative: from .x import y
                base = ".".join(filter(None, [package, base]))
            names |= {a.asname or a.name for a in node.names if _is_module(f"{base}.{a.name}".strip("."))}
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
              and getattr(node.value.func, "id", getattr(node.value.func, "attr", None)) == "import_module"):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def patches(source: str, package: str = "") -> list[str]:
    """What in `source` patches at run time, one line each: "line N: what"."""
    tree = ast.parse(source)
    modules = module_names(tree, package)
    found = []

    def on_module(node) -> bool:
        return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules

    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            imported = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
            if any(n == "mock" or n.endswith(".mock") or n == "monkeypatch" for n in imported):
                found.append(f"line {node.lineno}: imports mock")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
            target = node.args[0]
            if isinstance(target, ast.Name) and target.id in modules:
                found.append(f"line {node.lineno}: setattr on module {target.id}")
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for t in targets:
                for part in ast.walk(t):
                    if on_module(part) and isinstance(part.ctx, ast.Store | ast.Del):
                        found.append(f"line {node.lineno}: assigns {part.value.id}.{part.attr}")
    return found


def test_no_module_of_the_course_is_patched_at_run_time():
    offenders = []
    for path in course_files():
        rel = path.relative_to(ROOT)
        package = ".".join(rel.parts[:-1])
        offenders += [f"{rel} {what}" for what in patches(path.read_text(encoding="utf-8"), package)]
    assert not offenders, "patched at run time (hand the thing in instead):\n" + "\n".join(offenders)


def test_the_check_sees_each_kind_of_patch():
    """The three patterns the course used before: a mark installed by setattr, a bench reassigning a
    module's function, mock outside a test; and what is allowed (an object's attribute, a module's own
    function called)."""
    assert patches("import sys\nsetattr(sys.modules['m'], 'f', g)\nfrom common import comm\nsetattr(comm, 'f', g)") \
        == ["line 4: setattr on module comm"]
    assert patches("from common import distributed\ndistributed.set_cpu_threads = lambda: None") \
        == ["line 2: assigns distributed.set_cpu_threads"]
    assert patches("import os.path\nos.sep, x = '/', 1\ndel os.environ") == ["line 2: assigns os.sep",
                                                                          "line 3: assigns os.environ"]
    assert patches("from unittest import mock") == ["line 1: imports mock"]
    assert patches("import unittest.mock as m") == ["line 1: imports mock"]
    assert patches("from importlib import import_module\nc = import_module('common.comm')\nc.COUNTER = 1") \
        == ["line 3: assigns c.COUNTER"]
    assert patches("from common import comm\ncomm.COUNTER.calls = []\nblock.body = f\ncomm.time_all_to_alls(f)") == []
