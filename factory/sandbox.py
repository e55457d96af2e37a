"""Run untrusted Python in a throwaway subprocess with hard limits; a bad program costs one result, never the worker.

    require_sandbox()          # at start-up: raises SandboxUnavailable (one line) where it cannot be set up
    result = run_python(code, stdin="1 2\\n", limits=SandboxLimits(cpu_s=2, wall_s=5))
    result.ok, result.stdout, result.reason

What a submission gets (see factory/sandbox_launcher.py for how); it runs only where all of it can be set up
(root; or any user where the kernel allows unprivileged user namespaces), never with less:

- its own mount, PID, network, IPC, UTS and cgroup namespaces: no network at all, it sees only its own
  processes, and everything it starts (daemons included) dies with it; SysV and POSIX shared memory,
  semaphores and message queues live in its IPC namespace and vanish with it;
- a read-only, nosuid view of the host with the project, /root, /home, /work, /run and other scratch
  directories hidden; the only writable place is a private tmpfs of `disk_mb` (at /tmp, its cwd, and /dev/shm),
  which is gone when the run ends: nothing it writes reaches the host's disk;
- an unprivileged uid (as root: one of its own per run, no supplementary groups; otherwise a user namespace
  in which the worker's uid is the only one), no capabilities, no-new-privileges, a seccomp filter against
  new namespaces, mounts, keyrings, bpf and io_uring, a minimal environment (`PATH`, `HOME=/tmp`, `LANG`) and
  the system Python in isolated mode (`-I -S -B`);
- totals for the whole submission: `memory_mb` and `processes` in one control group (cgroup v2, or the v1
  memory and pids hierarchies; tmpfs pages count as memory too); where no cgroup can be made, the fallback is
  per process (address space `memory_mb` x at most `processes` processes of its own uid), and
  `sandbox_summary()` says which applies; plus per process: CPU seconds, address space, file size
  (stdout/stderr are files, so output is capped by it too), open files, no core dumps; and a wall-clock
  timeout after which everything is killed.
"""

from __future__ import annotations

import itertools
import json
import logging
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

from factory.sandbox_cgroup import Cgroup, cgroup_support, create_cgroup, remove_stale_cgroups

log = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
PROJECT = Path(__file__).resolve().parents[1]
HIDDEN = ("/work", "/root", "/home", "/run", "/var/tmp", "/srv", "/mnt", "/opt", "/media", "/var/lib", "/var/log",
          "/var/spool", "/var/mail", "/boot", "/lost+found")
REFUSED = 125  # the launcher's exit status when a step of the isolation failed (the reason is in its report)
_runs = itertools.count()


class SandboxUnavailable(RuntimeError):
    """This host cannot give the sandbox's isolation; submissions are refused rather than run with less."""


def sandbox_python() -> str:
    """The interpreter submissions run on: `FACTORY_SANDBOX_PYTHON`, else the system's /usr/bin/python3 (readable
    by the sandbox's unprivileged uid and with no project packages), else this one."""
    for candidate in (os.environ.get("FACTORY_SANDBOX_PYTHON"), "/usr/bin/python3"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return sys.executable


@dataclass(frozen=True)
class SandboxLimits:
    """Hard limits of one run; the defaults suit short test programs. Totals are for the whole submission."""

    cpu_s: int = 2
    """CPU seconds per process (RLIMIT_CPU); the wall clock bounds the total."""
    wall_s: float = 5.0
    """Wall-clock seconds before every process of the run is killed."""
    memory_mb: int = 256
    """Memory of all its processes together, tmpfs files included (cgroup); also each process's address space."""
    processes: int = 16
    """Processes and threads of the run together (cgroup pids.max and RLIMIT_NPROC of its own uid)."""
    disk_mb: int = 16
    """Size of its private tmpfs, the only writable place (/tmp and /dev/shm together)."""
    inodes: int = 1024
    """Files and directories it may create on that tmpfs."""
    file_mb: int = 1
    """Largest file, stdout and stderr included (RLIMIT_FSIZE)."""
    open_files: int = 64
    output_chars: int = 20_000
    """Characters of stdout/stderr kept in the result."""


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


USERNS_UID = 1000
"""The program's uid inside its user namespace when the worker is not root (the worker's own uid, mapped)."""


def _read_text(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def missing_requirement() -> str:
    """What this host lacks for the sandbox, '' when nothing (cheap checks; `require_sandbox` also tries a run)."""
    if sys.platform != "linux":
        return f"the code sandbox needs Linux namespaces; this is {sys.platform}"
    if not os.path.exists("/proc/self/ns/ipc"):
        return "the code sandbox needs IPC/PID/network/mount namespaces; this kernel has none (/proc/self/ns/ipc)"
    if os.geteuid() == 0:
        return ""
    if _read_text("/proc/sys/user/max_user_namespaces") == "0":
        why = "user.max_user_namespaces is 0"
    elif _read_text("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        why = "kernel.unprivileged_userns_clone is 0"
    else:
        why = "" if os.path.exists("/proc/self/ns/user") else "the kernel has no user namespaces"
    if why:
        return (f"the code sandbox needs root or unprivileged user namespaces; this process runs as uid "
                f"{os.geteuid()} and {why}: run the scorer as root, or allow user namespaces (sysctl)")
    return ""


def memory_limit_summary(limits: SandboxLimits) -> str:
    """Which totals are in force on this host, in one line (the env logs it at start-up)."""
    version, where = cgroup_support()
    if version:
        return (f"cgroup v{version}: {limits.memory_mb} MB and {limits.processes} processes for the whole "
                f"submission ({where})")
    return (f"no cgroup ({where}): per process {limits.memory_mb} MB of address space x at most "
            f"{limits.processes} processes ({limits.memory_mb * limits.processes} MB in all)")


def sandbox_summary(limits: SandboxLimits) -> str:
    """Every limit of one submission, in one line."""
    return (f"memory {memory_limit_summary(limits)}; disk {limits.disk_mb} MB tmpfs ({limits.inodes} files, "
            f"{limits.file_mb} MB per file); time {limits.wall_s:g} s wall, {limits.cpu_s} s CPU per process; "
            f"namespaces mount, pid, network, ipc, uts, cgroup")


_checked: dict[str, Any] | None = None


def require_sandbox() -> dict[str, Any]:
    """Check once per process that a submission can be fully isolated here, else raise SandboxUnavailable."""
    global _checked
    if _checked is None:
        missing = missing_requirement()
        if missing:
            raise SandboxUnavailable(missing)
        remove_stale_cgroups()
        result = run_python("print('ok')", limits=SandboxLimits(wall_s=10))
        if result.stdout.strip() != "ok":
            raise SandboxUnavailable(f"the code sandbox's trial run failed ({result.reason}): "
                                     f"{result.stderr.strip()[-300:]}")
        _checked = result.isolation
    return _checked


def isolation() -> dict[str, Any]:
    """What isolation a run gets on this machine (namespaces, read-only filesystem, cgroup, uid), probed once."""
    return require_sandbox()


def _hidden_paths() -> list[str]:
    """Paths to cover; never one that holds the Python we exec."""
    python = os.path.realpath(sandbox_python())
    keep = lambda p: not (python == p or python.startswith(p + "/"))  # noqa: E731
    candidates = [*HIDDEN, str(PROJECT)]
    return [p for p in candidates if os.path.isdir(p) and not os.path.islink(p) and keep(os.path.realpath(p))]


UID_BASE = 1 << 28


def _sandbox_uid(run: int) -> int:
    """A uid of its own per run, so process limits and kill-by-uid are per sandbox: unique among live worker
    processes (pids < 2^22) and among 64 runs of one process at a time (earlier ones are dead)."""
    return UID_BASE + ((os.getpid() & 0x3FFFFF) << 6) + run % 64


def _kill_uid(uid: int) -> None:
    """Kill whatever is left running under the sandbox's uid (the fallback where no cgroup holds the run)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits | None = None,
               files: dict[str, str] | None = None) -> SandboxResult:
    """Run `code` as `main.py` (plus `files`) in a fresh sandbox and return what happened.

    Raises SandboxUnavailable where the isolation cannot be set up; a misbehaving program is a result."""
    missing = missing_requirement()
    if missing:
        raise SandboxUnavailable(missing)
    limits = limits or SandboxLimits()
    run = next(_runs)
    userns = os.geteuid() != 0
    uid = USERNS_UID if userns else _sandbox_uid(run)
    root = Path(tempfile.mkdtemp(prefix="sandbox-"))
    group: Cgroup | None = None
    try:
        work = root / "work"
        work.mkdir()
        for name, text in {**(files or {}), "main.py": code}.items():
            (work / name).write_text(text, encoding="utf-8")
        root.chmod(0o700)
        group = create_cgroup(f"{os.getpid()}-{run}", memory_mb=limits.memory_mb,
                              processes=limits.processes + 2)  # + the launcher and init
        config = {
            "dir": str(work), "uid": uid, "userns": userns, "hide": _hidden_paths(),
            "report": str(root / "report.json"),
            "cgroup": group.procs_files if group else [],
            "limits": {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "processes": limits.processes,
                       "file_mb": limits.file_mb, "open_files": limits.open_files, "disk_mb": limits.disk_mb,
                       "inodes": limits.inodes},
            "argv": [sandbox_python(), "-I", "-S", "-B", "main.py"],
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"},
        }
        return _run(config, root, stdin, limits, group)
    finally:
        if group is not None:
            group.destroy()
        if not userns:  # as root the run's uid is its own; in a user namespace it is the worker's
            _kill_uid(uid)
        shutil.rmtree(root, ignore_errors=True)


def _run(config: dict[str, Any], root: Path, stdin: str, limits: SandboxLimits, group: Cgroup | None) -> SandboxResult:
    started = time.monotonic()
    with open(root / "stdout", "w+b") as out, open(root / "stderr", "w+b") as err, \
            open(root / "stdin", "w+b") as inp:
        inp.write(stdin.encode())
        inp.seek(0)
        for name in ("stdin", "stdout", "stderr"):  # reopenable through /dev/stdout by the run's own uid
            (root / name).chmod(0o666)
        process = subprocess.Popen(
            [sandbox_python(), "-I", "-S", str(LAUNCHER), json.dumps(config)], stdin=inp, stdout=out, stderr=err,
            cwd=root, env=config["env"], start_new_session=True, close_fds=True,
        )
        reason = ""
        try:
            process.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            reason = "timeout"
        finally:  # also when the caller's own timeout interrupts the wait: nothing is left running
            _kill_group(process.pid)
            if group is not None:
                group.kill()
            returncode = process.wait()
        seconds = time.monotonic() - started
        stdout, stderr = _read(out, limits.output_chars), _read(err, limits.output_chars)
    report = json.loads((root / "report.json").read_text() or "{}") if (root / "report.json").is_file() else {}
    if returncode == REFUSED and report.get("error"):
        raise SandboxUnavailable(f"the code sandbox could not be set up: {report['error']}")
    isolation = {**report, "memory_limit": memory_limit_summary(limits)}
    if group is not None:
        isolation["memory_peak_mb"] = group.peak_mb()
    if not reason and returncode != 0:
        reason = _why(returncode, stderr, limits, root, group)
    elif not reason and group is not None and group.oom_kills():
        # The submission went over its memory cap and the kernel killed one of its processes, not necessarily
        # the first one: the run is over its limit even if what survived exited 0.
        reason = "memory"
    return SandboxResult(returncode, stdout, stderr, seconds, reason, isolation)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(handle: Any, limit: int) -> str:
    handle.seek(0)
    return handle.read(limit * 4).decode("utf-8", errors="replace")[:limit]


def _why(returncode: int, stderr: str, limits: SandboxLimits, root: Path, group: Cgroup | None) -> str:
    if returncode in (128 + signal.SIGXCPU, -signal.SIGXCPU):
        return "cpu"
    too_big = (root / "stdout").stat().st_size >= limits.file_mb << 20
    if returncode in (128 + signal.SIGXFSZ, -signal.SIGXFSZ) or too_big:
        return "output"
    if "MemoryError" in stderr or (group is not None and group.oom_kills()):
        return "memory"
    if returncode > 128 or returncode < 0:
        return f"signal {abs(returncode) - (128 if returncode > 128 else 0)}"
    return f"exit {returncode}"
