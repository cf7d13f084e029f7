"""Build the default training text: English prose from the Python standard library's docstrings.

Every machine with Python has this text, so the course needs no download. The file it writes,
`common/corpus/stdlib_docstrings.txt`, ships with the project so that every machine trains on
exactly the same bytes (docstrings differ slightly between Python versions). Run it again with
`python common/make_corpus.py` to rebuild; any other text file works with `--data PATH`.
"""
import importlib
import importlib.util
import inspect
import pkgutil
import re
import warnings
from pathlib import Path

OUT = Path(__file__).parent / "corpus" / "stdlib_docstrings.txt"
SKIP = ("test", "idlelib", "tkinter", "turtle", "antigravity", "this", "lib2to3", "ensurepip", "venv")


def prose_paragraphs(doc: str):
    """Yield paragraphs that read as prose: mostly letters, no code or tables."""
    for para in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        text = " ".join(line.strip() for line in para.splitlines())
        letters = sum(c.isalpha() or c == " " for c in text)
        if len(text) >= 80 and letters / len(text) > 0.9 and not text.startswith((">>>", "..")):
            yield text


def main():
    warnings.simplefilter("ignore")
    seen, out = set(), []
    top = sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_"))
    names = []
    for name in top:  # the top-level modules, and the submodules of stdlib packages (email.*, xml.*)
        names.append(name)
        spec = importlib.util.find_spec(name)
        if spec and spec.submodule_search_locations and "site-packages" not in str(spec.origin):
            names += sorted(m.name for m in pkgutil.walk_packages(spec.submodule_search_locations, name + ".",
                                                                   onerror=lambda _: None)
                            if "._" not in m.name)
    for name in names:
        if name.split(".")[0].startswith(SKIP) or ".test" in name:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        origin = getattr(module, "__file__", "") or ""
        if "site-packages" in origin:
            continue  # only the standard library, not what a virtualenv happens to hold
        objects = [module] + [obj for _, obj in inspect.getmembers(module)
                              if (inspect.isclass(obj) or inspect.isfunction(obj))
                              and getattr(obj, "__module__", None) == name]
        methods = [m for cls in objects if inspect.isclass(cls)
                   for _, m in inspect.getmembers(cls, inspect.isfunction) if m.__module__ == name]
        for obj in objects + methods:
            for para in prose_paragraphs(inspect.getdoc(obj) or ""):
                if para not in seen:
                    seen.add(para)
                    out.append(para)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text("\n\n".join(out) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB, {len(out)} paragraphs)")


if __name__ == "__main__":
    main()
