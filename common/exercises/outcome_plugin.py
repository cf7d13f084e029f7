"""A pytest plugin for the grader: one record per test, with the first line of its failure (or the reason
it was skipped) and the whole failure text, written as JSON to the file --outcomes names.

    status  "passed"      its call ran and passed, and neither setup nor teardown failed
            "failed"      any phase failed; a module that did not import is one "failed" record under the
                          module's id with "phase": "collect"
            "skipped"     it (or its whole module) was skipped, or is an expected failure: nothing was checked
            "incomplete"  it started but its call never reported (the run was stopped): not a pass"""
import json

import pytest


def pytest_addoption(parser):
    parser.addoption("--outcomes", default=None, help="write each test's outcome to this JSON file")
    parser.addoption("--outcomes-select", default=None,
                     help="a JSON list of node ids: run only the tests they name (a function covers its parameters)")


def chosen(nodeid: str, wanted: list[str]) -> bool:
    return any(nodeid == n or nodeid.startswith(n + "[") or nodeid.startswith(n + "::") for n in wanted)


def pytest_collection_modifyitems(config, items):
    path = config.getoption("--outcomes-select")
    if not path:
        return
    with open(path) as f:
        wanted = json.load(f)
    keep = [item for item in items if chosen(item.nodeid, wanted)]
    dropped = [item for item in items if not chosen(item.nodeid, wanted)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _first_line(text: str, default: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else default


def _skip_reason(report) -> str:
    """The reason in one line: pytest keeps a skip as (file, line, "Skipped: reason")."""
    if hasattr(report, "wasxfail"):
        return _first_line(f"expected to fail: {report.wasxfail}" if report.wasxfail else "expected to fail", "")
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return _first_line(reason.removeprefix("Skipped: "), "skipped")


class _Recorder:
    def __init__(self, path):
        self.path, self.records = path, {}

    def pytest_runtest_logreport(self, report):
        rec = self.records.setdefault(report.nodeid, {"status": "incomplete", "line": "", "text": ""})
        if report.failed and rec["status"] != "failed":
            crash = getattr(report.longrepr, "reprcrash", None)
            text = str(report.longrepr) + "".join(f"\n{name}\n{body}" for name, body in report.sections)
            rec.update(status="failed", line=_first_line(crash.message if crash else text, "failed"), text=text[-60000:])
        elif report.skipped and rec["status"] in ("incomplete", "passed"):
            rec.update(status="skipped", line=_skip_reason(report))
        elif report.passed and report.when == "call" and rec["status"] == "incomplete":
            rec["status"] = "passed"

    def pytest_collectreport(self, report):
        if report.failed:
            text = str(report.longrepr)
            self.records[report.nodeid or "collection"] = {
                "status": "failed", "phase": "collect", "line": text.strip().splitlines()[-1] if text.strip() else
                "collection failed", "text": text}
        elif report.skipped and report.nodeid:     # a module skipped as a whole (pytest.skip at import)
            self.records[report.nodeid] = {"status": "skipped", "phase": "collect", "line": _skip_reason(report),
                                           "text": ""}

    def pytest_sessionfinish(self, session):
        with open(self.path, "w") as f:
            json.dump(self.records, f)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    path = config.getoption("--outcomes")
    if path:
        config.pluginmanager.register(_Recorder(path), "exercise_outcomes")
