"""Run some of the course's tests in a repository (the reference or a student's copy) and return
each test's outcome: {node_id: {"status": "passed"|"failed"|"skipped", "line": first line of the
failure, "text": the failure in full}}. A test that never reported (a timeout killed the run) is
"failed" with the line saying so."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def run_tests(repo: Path, node_ids: list[str], timeout_s: float = 900) -> dict[str, dict]:
    repo = Path(repo).resolve()
    with tempfile.TemporaryDirectory(prefix="grade_") as tmp:
        out = Path(tmp) / "outcomes.json"
        env = dict(os.environ, PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "common.exercises.outcome_plugin",
               f"--outcomes={out}", "-p", "no:cacheprovider", *node_ids]
        try:
            proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s)
            tail = (proc.stdout + proc.stderr)[-4000:]
        except subprocess.TimeoutExpired:
            tail = f"the tests ran past {timeout_s:.0f} s and were stopped"
        records = json.loads(out.read_text()) if out.exists() else {}
    result = {}
    for node in node_ids:
        hits = {k: v for k, v in records.items() if k == node or k.startswith(node + "[") or k.startswith(node + "::")}
        if not hits:     # its file did not import (a syntax error, say), or the run stopped first
            broken = records.get(node.split("::")[0]) or records.get("collection")
            result[node] = broken or {"status": "failed", "text": tail,
                                      "line": tail.strip().splitlines()[-1] if tail.strip() else "no result"}
            continue
        failed = [v for v in hits.values() if v["status"] == "failed"]
        result[node] = failed[0] if failed else {"status": "passed", "line": "", "text": ""}
    return result
