"""The shape of the course's trainers and optimizers, read from the source (one process, no ranks).

Every trainer takes its optimizer as an object with the step verbs (common/step_protocol.py), so no
trainer needs a second base to mix an optimizer in, and no subclass switches off what its parent set
up. A diamond such as `ZeroTrainer4D(Trainer4D, ZeroTrainer3D)` fails here.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERBS = {"forward_backward", "sync_gradients", "clip_grad_norm", "zero_grad", "grads_ready"}


def course_classes() -> dict:
    """{class name: (file, ClassDef)} of every class in the chapters and common/."""
    out = {}
    for path in sorted([*ROOT.glob("0[0-9]_*/*.py"), *ROOT.glob("common/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, (path.relative_to(ROOT), node))
    return out


def base_names(node: ast.ClassDef) -> list[str]:
    """The names of a class's bases, as written (`trainer_3d.Trainer3D` -> "Trainer3D")."""
    return [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "?") for b in node.bases]


def methods(node: ast.ClassDef) -> set[str]:
    return {f.name for f in node.body if isinstance(f, ast.FunctionDef)}


def trainers_and_optimizers(classes: dict) -> set[str]:
    """The classes that define a step verb, and every class built on one of them."""
    found = {name for name, (_, node) in classes.items() if methods(node) & VERBS}
    grew = True
    while grew:
        more = {name for name, (_, node) in classes.items() if set(base_names(node)) & found} - found
        found |= more
        grew = bool(more)
    return found


def test_the_walk_finds_the_course_s_trainers_and_optimizers():
    found = trainers_and_optimizers(course_classes())
    assert {"PipelineTrainer", "Trainer3D", "Trainer4D", "TPTrainer", "ReplicatedAdamW", "ShardedOptimizers",
            "ZeroOptimizer"} <= found


def test_no_trainer_or_optimizer_has_two_bases():
    classes = course_classes()
    two = [f"{path}: class {name}({', '.join(base_names(node))})"
           for name in sorted(trainers_and_optimizers(classes)) for path, node in [classes[name]]
           if len(node.bases) > 1 and base_names(node) != ["Protocol"]]
    assert not two, "a trainer or optimizer with two bases (pass the optimizer in instead):\n" + "\n".join(two)


def self_assigned(node: ast.ClassDef, none: bool) -> set[str]:
    """Attributes `self.x = ...` set in the class's methods (`none`: only those set to None)."""
    return {t.attr for a in ast.walk(node) if isinstance(a, ast.Assign)
            and (not none or isinstance(a.value, ast.Constant) and a.value.value is None)
            for t in a.targets if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "self"}


def ancestors(name: str, classes: dict) -> list[str]:
    bases = [b for b in base_names(classes[name][1]) if b in classes and b != name]
    return bases + [a for b in bases for a in ancestors(b, classes)]


def test_no_subclass_switches_off_what_its_parent_set_up():
    """`self.hook = None` in a subclass turns off what a parent does (ZeroTrainer3D once did it to the
    pipeline's per-stage all-reduce callback): the optimizer passed in says what happens instead."""
    classes = course_classes()
    off = []
    for name in sorted(trainers_and_optimizers(classes)):
        parents = [classes[a][1] for a in ancestors(name, classes)]
        theirs = set().union(set(), *(methods(p) | self_assigned(p, none=False) for p in parents))
        off += [f"{classes[name][0]}: {name} sets self.{attr} = None, which a parent sets up"
                for attr in sorted(self_assigned(classes[name][1], none=True) & theirs)]
    assert not off, "\n".join(off)
