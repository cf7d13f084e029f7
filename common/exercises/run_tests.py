"""Run some of the course's tests in a repository (the reference or a student's copy) and return
each test's outcome: {node_id: {"status": "passed"|"failed"|"skipped", "line": first line of the
failure (or the reason for the skip), "text": the failure in full}}. A node is "passed" only when every
test it names passed; one whose module did not import is "failed" with "phase": "collect"; a test that
never reported (a timeout killed the run) is "failed" with the line saying so."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .outcome_plugin import chosen


def run_tests(repo: Path, node_ids: list[str], timeout_s: float = 900) -> dict[str, dict]:
    repo = Path(repo).resolve()
    with tempfile.TemporaryDirectory(prefix="grade_") as tmp:
        out, select = Path(tmp) / "outcomes.json", Path(tmp) / "select.json"
        select.write_text(json.dumps(node_ids))
        env = dict(os.environ, PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1")
        # The modules, not the node ids, are named, and the plugin keeps only the tests asked for: named
        # node ids in a module that does not import would stop the whole run before any test ran.
        # (A module the copy lacks is left out too: pytest would refuse the whole command line.)
        modules = [m for m in dict.fromkeys(node.split("::")[0] for node in node_ids) if (repo / m).is_file()]
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "common.exercises.outcome_plugin",
               f"--outcomes={out}", f"--outcomes-select={select}", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", *modules]
        tail = ""
        try:
            if modules:          # with no path at all pytest would run every test of the repository
                proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s)
                tail = (proc.stdout + proc.stderr)[-4000:]
        except subprocess.TimeoutExpired:
            tail = f"the tests ran past {timeout_s:.0f} s and were stopped"
        finished = out.exists()
        records = json.loads(out.read_text()) if finished else {}
    result = {}
    for node in node_ids:
        module = node.split("::")[0]
        hits = {k: v for k, v in records.items() if chosen(k, [node])}
        if hits:
            result[node] = outcome(list(hits.values()), tail)
        elif module not in modules:
            result[node] = {"status": "failed", "line": f"{module} is not in {repo}", "text": ""}
        elif module in records or "collection" in records:      # its module did not import (a syntax error, say)
            result[node] = records.get(module) or records["collection"]
        elif finished:
            result[node] = {"status": "failed", "line": f"no test {node} in {repo} (renamed or removed?)", "text": tail}
        else:                # the run stopped (or pytest could not start) before it wrote a record
            result[node] = {"status": "failed", "text": tail,
                            "line": tail.strip().splitlines()[-1] if tail.strip() else "no result"}
    return result


def outcome(records: list[dict], tail: str = "") -> dict:
    """One node's outcome from its tests' records (a function's parameters, a class's methods): the first
    failure; else a test that never finished, as a failure; else the first skip; passed only if all passed."""
    for status in ("failed", "incomplete", "skipped"):
        found = [r for r in records if r["status"] == status]
        if found and status == "incomplete":
            return {"status": "failed", "line": "the test started but never finished (the run was stopped)",
                    "text": tail}
        if found:
            return found[0]
    return {"status": "passed", "line": "", "text": ""}
