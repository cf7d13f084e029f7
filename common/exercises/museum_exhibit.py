"""One exhibit of the museum of real bugs: its fields in the order the class lists and explains them.

The instructor's checkout holds every field (museum_catalog.py); a copy of the course handed to a student
holds only the public ones, `id`, `title`, `catch` and `see` (answer_keys.py writes that copy's catalog),
so the copy names a bug's symptom, never its cause, its place or its fix."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Exhibit:
    id: str             # "06.bug1": the chapter whose LAB sets it (`chapter`), then a name
    title: str          # what a user would report (the symptom, never the cause)
    bug_class: str = ""  # the class of real bug it belongs to
    file: str = ""       # planting replaces `old` (which must occur exactly once in `file`) by `new`
    old: str = ""
    new: str = ""
    catch: tuple = ()    # the course's own tests that fail on it (pytest node ids, cheapest first)
    see: tuple = ()      # the commands that show the symptom, for the student (no hint of the cause)
    key: str = ""        # how it is found with the course's tools, and why the fix is the fix (the answer key)
    # The defaults are a copy's: there `bug_class`, `file`, `old`, `new` and `key` are empty.

    @property
    def chapter(self) -> str:
        return self.id.split(".")[0]

    @property
    def has_key(self) -> bool:
        """False in a student's copy: the bug cannot be planted there, only graded."""
        return bool(self.file)
