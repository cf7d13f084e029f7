"""Nothing in the course is patched at run time: what a reader sees called is what runs.

Read statically (ast) over every .py file of the course outside tests/: no `mock` (unittest.mock, pytest's
monkeypatch) imported, no `setattr` on an imported module, no assignment to (or deletion of) an attribute
of an imported module, and neither on a class, function or module reached through one (`setattr(m.C, ...)`,
`m.C.f = g`: the module's source says what C is; an object it holds, `m.COUNTER.calls = []`, may change). A module that must behave differently is handed what differs (a span, a recorder, a
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
def _module_file(name: str) -> Path | None:
    """The source file of the module `name` (dotted): a file or package of the course, or of an installed
    package (looked up on disk, nothing imported); None if it is none."""
    top, *rest = name.split(".")
    for base in [ROOT / top] + _installed(top):
        path = base.joinpath(*rest)
        for file in (path.with_suffix(".py"), path / "__init__.py"):
            if file.is_file():
                return file
        if not rest and base.is_file():
            return base
    return None


def _is_module(name: str) -> bool:
    return _module_file(name) is not None


@functools.cache
def _defines(module: str, name: str) -> bool:
    """Is `name` a class, a function or a module in the module `module` (its own `class`, `def` or import,
    or a submodule), read from its source? A name bound by `=` (an object it holds) is not."""
    if _is_module(f"{module}.{name}"):
        return True
    file = _module_file(module)
    if file is None or file.suffix != ".py":
        return False
    for node in ast.parse(file.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return True
        if isinstance(node, ast.Import | ast.ImportFrom) and name in {
                a.asname or a.name.split(".")[0] for a in node.names}:
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


def module_names(tree: ast.AST, package: str) -> dict[str, str | None]:
    """The names a file binds to modules, each with the module's dotted name (None where the source does not
    say it): `import x [as y]`, `from p import m` (m a module), and `y = import_module("x")`."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                      for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                          # relative: from .x import y
                base = ".".join(filter(None, [package, base]))
            names |= {a.asname or a.name: f"{base}.{a.name}".strip(".") for a in node.names
                      if _is_module(f"{base}.{a.name}".strip("."))}
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
              and getattr(node.value.func, "id", getattr(node.value.func, "attr", None)) == "import_module"):
            arg = node.value.args[0] if node.value.args else None
            dotted = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
            names |= {t.id: dotted for t in node.targets if isinstance(t, ast.Name)}
    return names


def patches(source: str, package: str = "") -> list[str]:
    """What in `source` patches at run time, one line each: "line N: what"."""
    tree = ast.parse(source)
    modules = module_names(tree, package)
    found = []

    def on_module(node) -> bool:
        return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules

    def through_module(node) -> str | None:
        """`m.C` or `m.C.D…` with C a class, function or module of the module m: its text, else None."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.insert(0, node.attr)
            node = node.value
        if attrs and isinstance(node, ast.Name) and modules.get(node.id) and _defines(modules[node.id], attrs[0]):
            return ".".join([node.id] + attrs)
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            imported = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
            if any(n == "mock" or n.endswith(".mock") or n == "monkeypatch" for n in imported):
                found.append(f"line {node.lineno}: imports mock")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
            target = node.args[0]
            if isinstance(target, ast.Name) and target.id in modules:
                found.append(f"line {node.lineno}: setattr on module {target.id}")
            elif through_module(target):
                found.append(f"line {node.lineno}: setattr on {through_module(target)}")
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for t in targets:
                for part in ast.walk(t):
                    if not (isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store | ast.Del)):
                        continue
                    if on_module(part):
                        found.append(f"line {node.lineno}: assigns {part.value.id}.{part.attr}")
                    elif through_module(part.value):
                        found.append(f"line {node.lineno}: assigns {through_module(part.value)}.{part.attr}")
    return sorted(found, key=lambda line: int(line.split()[1].rstrip(":")))     # in the file's order


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


def test_the_check_sees_a_patch_through_a_module():
    """A class's or function's attribute reached through a module (how breakdown_pp.py once timed the
    executor and torch's pipelining): flagged by assignment, deletion or setattr, wherever it sits; an
    object the module holds (common/comm.COUNTER) is not."""
    assert patches("from importlib import import_module\npe = import_module('03_pipeline_parallel.pipeline_executor')\n"
                   "def f():\n    pe.PipelineExecutor.__init__ = g") == ["line 4: assigns pe.PipelineExecutor.__init__"]
    assert patches("from torch.distributed.pipelining import schedules\n"
                   "setattr(schedules._PipelineSchedule, '_compute_loss', g)\n"
                   "del schedules._PipelineSchedule.step") == [
        "line 2: setattr on schedules._PipelineSchedule", "line 3: assigns schedules._PipelineSchedule.step"]
    assert patches("import torch\ntorch.nn.Linear.forward = g") == ["line 2: assigns torch.nn.Linear.forward"]
    assert patches("from . import measured_executor\nmeasured_executor.pipeline_executor.PipelineExecutor.run = g",
                   "03_pipeline_parallel") == ["line 2: assigns measured_executor.pipeline_executor.PipelineExecutor.run"]
    assert patches("from common import comm\ncomm.COUNTER.calls = []\nsetattr(comm.COUNTER, 'calls', [])") == []
