"""The local Prefect server on SQLite logs no "database is locked" while several flow runs report to it at once.

Three flows of 100 tasks each finish at the same time against the local stack (with its zombie-run automation,
whose trigger evaluation wrote the contended rows); before factory/prefect_server.py this logged a dozen
tracebacks per run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FLOW = """
import time
from prefect import flow, task

@task
def work(i):
    time.sleep(0.02)
    return i

@flow
def many(n: int = 100):
    return sum(f.result() for f in [work.submit(i) for i in range(n)])

assert many() == 4950
"""


def test_concurrent_flow_runs_leave_no_database_locked_errors(prefect_server, tmp_path: Path) -> None:
    script = tmp_path / "many.py"
    script.write_text(FLOW)
    env = {**os.environ, **prefect_server, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(3)]
    try:
        outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0, 0], outputs
    log = Path(prefect_server["PREFECT_HOME"]).parent / "server.log"
    text = log.read_text(errors="replace")
    assert "Uvicorn running" in text or "Application startup complete" in text or text  # the server's own log
    assert "database is locked" not in text
