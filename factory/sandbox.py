"""Run untrusted Python in a throwaway subprocess with hard limits; a bad program costs one result, never the worker.

    result = run_python(code, stdin="1 2\\n", limits=SandboxLimits(cpu_s=2, wall_s=5))
    result.ok, result.stdout, result.reason

What a submission gets (see factory/sandbox_launcher.py for how):

- a fresh directory (deleted afterwards) as its cwd, mounted at /tmp, and a minimal environment
  (`PATH`, `HOME=/tmp`, `LANG`); Python runs isolated (`-I -S -B`: no site-packages, no user paths);
- limits: CPU seconds, address space, process count, file size (stdout/stderr are files, so output is capped by
  it too), open files, no core dumps, and a wall-clock timeout after which the whole process tree is killed;
- as root: its own unprivileged uid, so it cannot signal or read what the worker owns, and the process limit is
  its own;
- where `unshare` is permitted (root or CAP_SYS_ADMIN; it is on this project's machines): no network at all
  (an empty network namespace), its own PID namespace (everything it started dies with it; it cannot see the
  worker's processes) and a mount namespace that hides the project, /root, /home, /work, /run and other
  scratch directories behind empty read-only mounts.
- without that privilege: `socket` is replaced inside the program's Python before it runs, which stops ordinary
  code but not a determined one (ctypes); `SandboxResult.isolation` says which case applied.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
PROJECT = Path(__file__).resolve().parents[1]
HIDDEN = ("/work", "/root", "/home", "/run", "/var/tmp", "/dev/shm", "/srv", "/mnt", "/opt")

_SOCKET_BLOCK = (
    "import socket as _s\n"
    "def _no(*a, **k):\n    raise PermissionError('network access is disabled in the sandbox')\n"
    "_s.socket = _s.create_connection = _s.socketpair = _s.fromfd = _no\n"
    "del _s, _no\n"
)
_uids = itertools.count()


def sandbox_python() -> str:
    """The interpreter submissions run on: `FACTORY_SANDBOX_PYTHON`, else the system's /usr/bin/python3 (readable
    by the sandbox's unprivileged uid and with no project packages), else this one."""
    for candidate in (os.environ.get("FACTORY_SANDBOX_PYTHON"), "/usr/bin/python3"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return sys.executable


@dataclass(frozen=True)
class SandboxLimits:
    """Hard limits of one run; the defaults suit short test programs."""

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 256
    processes: int = 16
    file_mb: int = 1
    open_files: int = 64
    output_chars: int = 20_000


@dataclass
class SandboxResult:
    """What a run did: exit status, (truncated) output, why it was stopped, and the isolation it really had."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    reason: str = ""  # "" | "timeout" | "cpu" | "memory" | "output" | "signal N" | "exit N"
    isolation: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.reason


def isolation() -> dict[str, Any]:
    """What isolation a run gets on this machine (namespaces, hidden filesystem, own uid), probed once."""
    global _probed
    if _probed is None:
        result = run_python("pass", limits=SandboxLimits(wall_s=10))
        _probed = {**result.isolation, "own_uid": os.getuid() == 0}
    return _probed


_probed: dict[str, Any] | None = None


def _hidden_paths() -> list[str]:
    """Paths to cover; never one that holds the Python we exec."""
    python = os.path.realpath(sandbox_python())
    keep = lambda p: not (python == p or python.startswith(p + "/"))  # noqa: E731
    candidates = [*HIDDEN, str(PROJECT)]
    return [p for p in candidates if os.path.isdir(p) and keep(os.path.realpath(p))]


def _sandbox_uid() -> int:
    """A uid of its own per run (as root), so process limits and kill-by-uid are per sandbox."""
    return 200_000 + (os.getpid() * 1_000 + next(_uids)) % 1_000_000


def _kill_uid(uid: int) -> None:
    """Kill whatever is left running under the sandbox's uid (without namespaces a program may escape its group)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits | None = None,
               files: dict[str, str] | None = None, namespaces: bool = True) -> SandboxResult:
    """Run `code` as `main.py` (plus `files`) in a fresh sandbox directory and return what happened."""
    limits = limits or SandboxLimits()
    root = Path(tempfile.mkdtemp(prefix="sandbox-"))
    work = root / "work"
    work.mkdir()
    is_root = os.getuid() == 0
    uid = _sandbox_uid() if is_root else os.getuid()
    try:
        for name, text in {**(files or {}), "main.py": code}.items():
            (work / name).write_text(text, encoding="utf-8")
        (work / "_guard.py").write_text(_SOCKET_BLOCK + "import runpy\nrunpy.run_path('main.py', run_name='__main__')\n")
        if is_root:
            for path in (work, *work.iterdir()):
                os.chown(path, uid, uid)
        work.chmod(0o700)
        root.chmod(0o711)  # the sandbox uid may pass through to work/ (needed without a mount namespace), not list
        config = {
            "dir": str(work), "uid": uid, "namespaces": namespaces, "hide": _hidden_paths(),
            "report": str(root / "report.json"),
            "limits": {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "processes": limits.processes,
                       "file_mb": limits.file_mb, "open_files": limits.open_files},
            "argv": [sandbox_python(), "-I", "-S", "-B", "_guard.py"],
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"},
        }
        return _run(config, root, stdin, limits, uid if is_root else None)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(config: dict[str, Any], root: Path, stdin: str, limits: SandboxLimits, uid: int | None) -> SandboxResult:
    started = time.monotonic()
    with open(root / "stdout", "w+b") as out, open(root / "stderr", "w+b") as err, \
            open(root / "stdin", "w+b") as inp:
        inp.write(stdin.encode())
        inp.seek(0)
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(config)], stdin=inp, stdout=out, stderr=err,
            cwd=root, env=config["env"], start_new_session=True, close_fds=True,
        )
        reason = ""
        try:
            process.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            reason = "timeout"
        finally:  # also when the caller's own timeout interrupts the wait: nothing is left running
            _kill_group(process.pid)
            if uid is not None:
                _kill_uid(uid)
            returncode = process.wait()
        seconds = time.monotonic() - started
        stdout, stderr = _read(out, limits.output_chars), _read(err, limits.output_chars)
    isolation = json.loads((root / "report.json").read_text()) if (root / "report.json").is_file() else {}
    isolation["network"] = "namespace" if isolation.get("namespaces") else "python-socket-block"
    if not reason and returncode != 0:
        reason = _why(returncode, stderr, limits, root)
    return SandboxResult(returncode, stdout, stderr, seconds, reason, isolation)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(handle: Any, limit: int) -> str:
    handle.seek(0)
    return handle.read(limit * 4).decode("utf-8", errors="replace")[:limit]


def _why(returncode: int, stderr: str, limits: SandboxLimits, root: Path) -> str:
    if returncode in (128 + signal.SIGXCPU, -signal.SIGXCPU):
        return "cpu"
    if returncode in (128 + signal.SIGXFSZ, -signal.SIGXFSZ) or (root / "stdout").stat().st_size >= limits.file_mb << 20:
        return "output"
    if "MemoryError" in stderr:
        return "memory"
    if returncode > 128 or returncode < 0:
        return f"signal {abs(returncode) - (128 if returncode > 128 else 0)}"
    return f"exit {returncode}"
