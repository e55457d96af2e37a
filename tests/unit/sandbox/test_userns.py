"""The sandbox as a non-root worker: a user namespace of its own instead of root's per-run uid.

Run as `nobody` through `setpriv` with the system Python (the sandbox imports only the standard library), so
CI (root) exercises this path too; skipped where setpriv is missing, the project is not readable by `nobody`, or
the kernel refuses unprivileged user namespaces (then the one-line refusal is checked instead)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.unit.sandbox.test_hostile import CASES, LIMITS, PRELUDE

PROJECT = Path(__file__).resolve().parents[3]
NAMES = ["writes outside", "ptrace", "reads secrets", "tcp to the host", "sysv shm pinned", "disk fill",
         "new namespaces and mounts", "fork bomb", "daemon", "setuid binary"]
DRIVER = """
import json, sys
from factory.sandbox import SandboxLimits, SandboxUnavailable, require_sandbox, run_python, sandbox_summary
try:
    isolation = require_sandbox()
except SandboxUnavailable as error:
    print(json.dumps({"refused": str(error)})); sys.exit(0)
cases, limits = json.loads(sys.argv[1]), SandboxLimits(**json.loads(sys.argv[2]))
results = {name: run_python(code, limits=limits) for name, code in cases.items()}
print(json.dumps({"isolation": isolation, "summary": sandbox_summary(limits),
                  "results": {n: [r.reason, r.stdout[-300:], r.seconds] for n, r in results.items()}}))
"""


def as_nobody(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-S",
                           "-c", DRIVER, *args], capture_output=True, text=True, timeout=120, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(PROJECT), "LANG": "C.UTF-8"})


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.access("/usr/bin/python3", os.X_OK),
                    reason="needs root (to become nobody), setpriv and /usr/bin/python3")
def test_hostile_submissions_as_a_non_root_worker():
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "test", "-r",
                            str(PROJECT / "factory" / "sandbox.py")])
    if probe.returncode != 0:
        pytest.skip(f"{PROJECT} is not readable by nobody")
    values = {"WORKER": "1", "PORT": "9", "PROJECT": __file__, "TAG": "factory-hostile"}
    cases = {}
    for name in NAMES:
        code = CASES[name][0]
        for key, value in values.items():
            code = code.replace(key, value)
        cases[name] = PRELUDE + code
    limits = {k: getattr(LIMITS, k) for k in ("cpu_s", "wall_s", "memory_mb", "processes", "disk_mb", "inodes",
                                              "file_mb")}
    done = as_nobody(json.dumps(cases), json.dumps(limits))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    if "refused" in report:  # a kernel without unprivileged user namespaces: one line saying so, no run
        assert "needs root or unprivileged user namespaces" in report["refused"] and "\n" not in report["refused"]
        return
    assert "user" in report["isolation"]["namespaces"] and report["isolation"]["uid"] == 1000
    assert "memory" in report["summary"]
    for name, (reason, stdout, seconds) in report["results"].items():
        allowed = CASES[name][1]
        assert "ESCAPED" not in stdout, (name, stdout)
        assert allowed is None or reason in allowed, (name, reason, stdout)
        assert seconds < LIMITS.wall_s + 3
