"""One schedule registry, and no import circle.

A schedule is added to the course in one place, chapter 03's `pipeline_schedules.SCHEDULES`: in a copy of the
course whose registry gains the one line `SCHEDULES["gpipe2"] = SCHEDULES["gpipe"]`, chapter 03's and chapter
04's scripts train with `--schedule gpipe2` to the single-device losses (their `main`, imported from the copy,
on spawned ranks), and chapter 07's planner explains a layout that runs it. And the course's own modules import each other without a circle (read from the source).
"""
import ast
import shutil
import subprocess
import sys
from importlib import import_module
from pathlib import Path

from harness import ROOT, losses, max_rel_diff, ok, run_group

STEPS = ["--steps", "3", "--seq-len", "32", "--global-batch", "8", "--quiet"]


def course_copy(tmp: Path) -> Path:
    """The course's files (git's, tracked or not ignored, as they are in the working tree) copied under tmp, with
    gpipe2 registered."""
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        if (ROOT / name).is_file():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp / name)
    with open(tmp / "03_pipeline_parallel" / "pipeline_schedules.py", "a") as f:
        f.write('SCHEDULES["gpipe2"] = SCHEDULES["gpipe"]\n')
    return tmp


def train_in(course: str, script: str, flags: list) -> list[dict]:
    """A job on every rank of a spawned group: `script`'s main (a module of the copy, `03_pipeline_parallel.
    train_pp`) imported from the copy, not from the course, and run with `flags`; its metrics rows."""
    sys.path.insert(0, course)
    for name in [n for n in sys.modules if n.split(".")[0] == "common" or n[:1].isdigit()]:
        del sys.modules[name]          # the course's own, which the ranks start with (harness.PRELOAD)
    module = import_module(script)
    assert Path(module.__file__).is_relative_to(course), module.__file__          # the copy's, with gpipe2
    return module.main(STEPS + flags)


def test_a_schedule_added_in_one_line_trains_and_is_planned(tmp_path):
    course = str(course_copy(tmp_path))
    (one_device,) = run_group(1, [("test_pp_registry:train_in", course, "03_pipeline_parallel.train_pp", [])])
    pipeline, grid = run_group(2, [
        ("test_pp_registry:train_in", course, "03_pipeline_parallel.train_pp", ["--schedule", "gpipe2",
                                                                                "--microbatches", "2"]),
        ("test_pp_registry:train_in", course, "04_3d_combined.train_3d", ["--dp", "1", "--tp", "1", "--pp", "2",
                                                                          "--schedule", "gpipe2", "--microbatches",
                                                                          "2", "--sample-tokens", "0"])])
    one_device, pipeline, grid = (losses(ok(r)) for r in (one_device, pipeline, grid))
    assert len(one_device) == 3 and max_rel_diff(pipeline, one_device) <= 1e-6, (pipeline, one_device)
    assert max_rel_diff(grid, one_device) <= 1e-6, (grid, one_device)
    plan = subprocess.run([sys.executable, "07_choosing_a_layout/choose_layout.py", "--model", "tiny", "--world", "2",
                           "--explain", "dp=1,tp=1,pp=2,schedule=gpipe2,m=2"], cwd=course, capture_output=True,
                          text=True, timeout=600)
    assert plan.returncode == 0 and "gpipe2" in plan.stdout, plan.stdout[-2000:] + plan.stderr[-2000:]


def course_modules() -> dict[str, Path]:
    """Every Python module of the course by its dotted name (03_pipeline_parallel.pipeline_schedules)."""
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in ROOT.glob("[0-9c]*/**/*.py")
            if ".venv" not in p.parts and p.name != "__init__.py"}


def imports_of(name: str, path: Path, known: set) -> set[str]:
    """The course modules `name` imports: `import x`, `from x import y` (x.y where that is a module), relative
    imports, and import_module("...") with a constant name; at any depth of the file (a function's too)."""
    package, found = name.rpartition(".")[0], set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant):
            targets = [node.args[0].value]
        found |= {t for t in targets if t in known}
    return found - {name}


def find_circle(graph: dict[str, set]) -> list[str] | None:
    """A circle of imports in `graph` (module -> the modules it imports), or None: a depth-first search."""
    state, path = {}, []                      # state: 1 on the current path, 2 done

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def test_no_module_of_the_course_imports_in_a_circle():
    modules = course_modules()
    graph = {name: imports_of(name, path, set(modules)) for name, path in modules.items()}
    assert graph["03_pipeline_parallel.pipeline_schedules"] >= {"03_pipeline_parallel.v_schedules"}   # read at all
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle(graph) is None, " -> ".join(find_circle(graph))
