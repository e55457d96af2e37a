"""A test run that leaves a process running fails, names the process, and ends it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[3]

LEAKY = '''
import subprocess, sys

def test_starts_a_server_and_forgets_it(tmp_path):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "--store", str(tmp_path)],
                     start_new_session=True)  # reparented away from pytest if it dies first: found by its marker
'''

TIDY = '''
import subprocess, sys

def test_starts_and_stops(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    proc.terminate()
    proc.wait()
'''


def run_inner(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "FACTORY_TEST_SESSION"}  # a session of its own
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_a_leaked_process_fails_the_run_and_is_ended(tmp_path: Path) -> None:
    done = run_inner(tmp_path, LEAKY)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "1 passed" in done.stdout and "outlived them" in done.stdout and "time.sleep(120)" in done.stdout
    left = [p for p in psutil.process_iter(["cmdline"]) if "time.sleep(120)" in " ".join(p.info["cmdline"] or ())
            and str(tmp_path) in " ".join(p.info["cmdline"] or ())]
    assert not left


def test_a_tidy_run_passes(tmp_path: Path) -> None:
    done = run_inner(tmp_path, TIDY)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "outlived" not in done.stdout
