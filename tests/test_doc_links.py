"""Every relative link in every Markdown file of the course points at a file that exists (and, with an
anchor, at a heading of that file): a moved file or a renamed section cannot leave a dead link behind.
In a copy handed to a student (`make exercises`, a museum copy), which leaves the answer keys out, a link
to a key is not followed: the instructor's checkout checks it."""
import re
import subprocess
from pathlib import Path

from common.exercises.answer_keys import is_key

ROOT = Path(__file__).resolve().parents[1]
KEYS_LEFT_OUT = not any(ROOT.glob("0*/LAB_ANSWERS.md"))         # a student's or a museum copy
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return [ROOT / f for f in tracked] or sorted(ROOT.glob("**/*.md"))


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces → '-'."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
    return out


def test_every_relative_link_resolves():
    dead = []
    for md in markdown_files():
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)      # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (md.parent / file).resolve() if file else md
            if not path.exists() and KEYS_LEFT_OUT and path.is_relative_to(ROOT) and is_key(path.relative_to(ROOT)):
                continue
            if not path.exists():
                dead.append(f"{md.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                dead.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    assert not dead, "dead links:\n" + "\n".join(dead)
