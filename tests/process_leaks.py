"""Find processes the tests started and left running, so a test run fails instead of leaving servers behind.

Every process the tests start inherits `FACTORY_TEST_SESSION` (set by tests/conftest.py, or by scripts/test.sh
for the whole run); one that still runs once the tests are over is a leak, wherever it was reparented to.
Processes whose command line or working directory lies under the session's temporary directory count too
(for children started with a replaced environment). SLURM and munge daemons, which the SLURM fixture starts
on purpose and leaves up, are not leaks.

    python -m tests.process_leaks MARKER   # scripts/test.sh: list (and end) leftovers, exit 1 if any
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil

MARKER_ENV = "FACTORY_TEST_SESSION"
DAEMONS = {"slurmctld", "slurmd", "slurmdbd", "munged"}


def _ours(proc: psutil.Process) -> set[int]:
    """This process and its ancestors (the shells and pytest that run the check carry the marker too)."""
    pids = {proc.pid}
    for parent in proc.parents():
        pids.add(parent.pid)
    return pids


def find_leaks(marker: str, *, paths: tuple[str, ...] = (), spare: set[int] = frozenset()) -> list[psutil.Process]:
    """Live processes (not zombies, not this one or its ancestors, not `spare`) carrying `marker` or under `paths`."""
    skip = _ours(psutil.Process()) | set(spare)
    leaks = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        if proc.pid in skip or proc.info["status"] == psutil.STATUS_ZOMBIE or proc.info["name"] in DAEMONS:
            continue
        try:
            marked = proc.environ().get(MARKER_ENV) == marker
            cmdline = " ".join(proc.info["cmdline"] or ())
            cwd = proc.cwd() if paths else ""
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if marked or any(path + os.sep in cmdline + os.sep or (cwd + os.sep).startswith(path + os.sep) for path in paths):
            leaks.append(proc)
    return leaks


def describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {proc.pid} (gone)"


def reap_leaks(marker: str, *, paths: tuple[str, ...] = (), spare: set[int] = frozenset(),
               grace_s: float = 10.0) -> list[str]:
    """Wait up to `grace_s` for stragglers to exit; end (SIGTERM, then SIGKILL) and describe those that do not."""
    deadline = time.monotonic() + grace_s
    leaks = find_leaks(marker, paths=paths, spare=spare)
    while leaks and time.monotonic() < deadline:
        time.sleep(0.5)
        leaks = find_leaks(marker, paths=paths, spare=spare)
    found = [describe(proc) for proc in leaks]
    for proc in leaks:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(leaks, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return found


def main(argv: list[str]) -> int:
    marker = argv[0] if argv else os.environ.get(MARKER_ENV, "")
    if not marker:
        print(f"usage: python -m tests.process_leaks MARKER (or set ${MARKER_ENV})", file=sys.stderr)
        return 2
    found = reap_leaks(marker, grace_s=5.0)
    for line in found:
        print(f"left running by the tests (now ended): {line}", file=sys.stderr)
    if found:
        print(f"{len(found)} process(es) outlived the tests: stop what a test starts in its fixture or finally",
              file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
