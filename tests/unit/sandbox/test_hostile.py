"""Hostile submissions against factory.sandbox: each one ends (stopped, or a normal result), none gets out, the
worker stays healthy, and the host keeps nothing of it (SysV IPC objects, files, processes, cgroups).

Each program prints ESCAPED when its attack worked; the test fails on that marker, on a run that takes much
longer than its wall clock, and on anything the run left on the host. Parallel-safe: every run has its own uid,
cgroup and namespaces, and the leftover checks look only at this process's uids and at names of this test.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from factory.sandbox import UID_BASE, SandboxLimits, missing_requirement, require_sandbox, run_python
from factory.sandbox_cgroup import PREFIX, cgroup_support

pytestmark = pytest.mark.skipif(bool(missing_requirement()), reason=missing_requirement() or "ok")

LIMITS = SandboxLimits(cpu_s=1, wall_s=2.0, memory_mb=128, processes=8, disk_mb=8, inodes=256, file_mb=1)
TAG = "factory-hostile"
SECRET = "s3cr3t-" + os.urandom(6).hex()
PROJECT_FILE = os.path.abspath(__file__)
PRELUDE = "import ctypes, os, signal, socket, subprocess, sys, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"

# name -> (program, reasons it may end with; "" is a normal exit, None: any)
CASES: dict[str, tuple[str, set[str] | None]] = {
    # --- processes ---
    "fork bomb": ("while True:\n    try:\n        os.fork()\n    except OSError:\n        pass", None),
    "thread bomb": ("import threading\nn = 0\ntry:\n    while True:\n"
                    "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); n += 1\n"
                    "except RuntimeError:\n    pass\nif n >= 8:\n    print('ESCAPED', n)\n"
                    "sys.stdout.flush()\nos._exit(0)", {""}),
    "many processes": ("kids = 0\nfor _ in range(50):\n    try:\n        pid = os.fork()\n    except OSError:\n"
                       "        break\n    if pid == 0:\n        time.sleep(60)\n    kids += 1\n"
                       "print('ESCAPED' if kids >= 8 else 'capped at', kids)\nsys.stdout.flush()\nos._exit(0)", {""}),
    "kills its parent": ("os.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(1)", None),
    "kills everything": ("os.kill(-1, signal.SIGKILL)\ntime.sleep(1)", None),
    "kills the worker": ("try:\n    os.kill(WORKER, signal.SIGKILL)\n    print('ESCAPED')\n"
                         "except ProcessLookupError:\n    pass", {""}),
    "daemon": ("if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        signal.signal(signal.SIGTERM, "
               "signal.SIG_IGN)\n        time.sleep(600)\n    os._exit(0)\nprint('parent done')", {""}),
    "infinite loop": ("while True:\n    pass", {"cpu", "timeout"}),
    "sleeps forever": ("time.sleep(1000)", {"timeout"}),
    # --- memory ---
    "big allocation": ("x = bytearray(8 << 30)\nprint('ESCAPED')", {"memory"}),
    "many processes x memory": (
        "r, w = os.pipe()\nfor _ in range(6):\n    if os.fork() == 0:\n        data = b'x' * (60 << 20)\n"
        "        os.write(w, b'1')\n        time.sleep(60)\n        os._exit(0)\nos.close(w)\ngot = 0\n"
        "import select\ndeadline = time.time() + 1.2\nwhile got < 6 and select.select([r], [], [], "
        "max(0, deadline - time.time()))[0]:\n    got += len(os.read(r, 6))\n"
        "print('ESCAPED' if got >= 6 else 'held', got)\nsys.stdout.flush()\nos._exit(0)", None),
    "sysv shm pinned": (
        "libc.shmat.restype = ctypes.c_void_p\nsid = libc.shmget(0x5A5A0001, 32 << 20, 0o1000 | 0o666)\n"
        "addr = libc.shmat(sid, None, 0)\nif addr not in (None, ctypes.c_void_p(-1).value):\n"
        "    ctypes.memset(addr, 7, 32 << 20)\nprint('segment', sid)", {""}),
    "sysv shm huge": (
        "libc.shmat.restype = ctypes.c_void_p\nsid = libc.shmget(0x5A5A0002, 1 << 30, 0o1000 | 0o666)\n"
        "addr = libc.shmat(sid, None, 0)\nif sid >= 0 and addr not in (None, ctypes.c_void_p(-1).value):\n"
        "    ctypes.memset(addr, 7, 1 << 30)\n    print('ESCAPED')", None),
    "sysv semaphores and queues": ("print(libc.semget(0x5A5A0003, 4, 0o1000 | 0o666), "
                                   "libc.msgget(0x5A5A0004, 0o1000 | 0o666))", {""}),
    "posix shm fill": ("n = 0\ntry:\n    with open('/dev/shm/TAG-shm', 'wb') as f:\n        while True:\n"
                       "            f.write(b'x' * (256 << 10)); f.flush(); n += 1\nexcept OSError:\n    pass\n"
                       "print('ESCAPED' if n * 256 > 8 << 10 else 'held at', n)", None),
    "posix shm via multiprocessing": (
        "from multiprocessing import shared_memory\nm = shared_memory.SharedMemory('TAG-mp', create=True, "
        "size=64 << 20)\nm.buf[:] = b'x' * (64 << 20)\nprint('ESCAPED')", None),
    "stdout flood": ("while True:\n    print('x' * 100000)", {"output"}),
    "stderr flood": ("while True:\n    sys.stderr.write('x' * 100000)", None),
    # --- disk ---
    "disk fill": ("n = 0\ntry:\n    while True:\n        open(f'TAG-{n}', 'wb').write(b'x' * (512 << 10)); n += 1\n"
                  "except OSError:\n    pass\nprint('ESCAPED' if n > 16 else 'held at', n)", {""}),
    "inode fill": ("n = 0\ntry:\n    while True:\n        open(f'e{n}', 'w').close(); n += 1\nexcept OSError:\n"
                   "    pass\nprint('ESCAPED' if n > 256 else 'held at', n)", {""}),
    "huge file": ("open('TAG-big', 'wb').write(b'x' * (64 << 20))\nprint('ESCAPED')", {"output", "exit 1"}),
    "writes outside": ("for p in ('/etc', '/usr', '/var/tmp', '/var/cache', '/home', '/work', '/opt', '/root', '/',"
                       " '/sys', '/proc', '/dev', '/run', '/srv'):\n    try:\n        open(p + '/TAG-out', 'w')"
                       ".write('x')\n        print('ESCAPED', p)\n    except OSError:\n        pass", {""}),
    "symlink and hardlink tricks": (
        "os.symlink('/work', 'w'); os.symlink('/proc/1/root/root', 'r')\nfor p in ('w', 'r', '/proc/self/root/work',"
        " '/proc/1/cwd/../work'):\n    if os.path.isdir(p) and os.listdir(p):\n        print('ESCAPED', p)\n"
        "try:\n    os.link('/etc/passwd', 'pw')\n    print('ESCAPED link')\nexcept OSError:\n    pass", {""}),
    # --- secrets ---
    "reads env vars": ("blob = repr(dict(os.environ)) + open('/proc/self/environ').read()\n"
                       "extra = set(os.environ) - {'PATH', 'HOME', 'LANG', 'LC_CTYPE'}\n"
                       "if 'SECRET' in blob or extra:\n    print('ESCAPED', extra)", {""}),
    "reads secrets": ("for p in ('PROJECT', '/etc/shadow', '/root/.bash_history', '/work/main/README.md'):\n"
                      "    try:\n        open(p).read(1)\n        print('ESCAPED', p)\n    except OSError:\n"
                      "        pass\nfor d in ('/work', '/root', '/home', '/run', '/opt'):\n"
                      "    if os.path.isdir(d) and os.listdir(d):\n        print('ESCAPED', d)", {""}),
    "reads host /proc": ("pids = [p for p in os.listdir('/proc') if p.isdigit()]\nfor p in pids:\n    try:\n"
                         "        if b'pytest' in open(f'/proc/{p}/cmdline', 'rb').read():\n"
                         "            print('ESCAPED', p)\n    except OSError:\n        pass\n"
                         "if len(pids) > 3:\n    print('ESCAPED', pids)", {""}),
    "inherited descriptors": ("fds = [int(f) for f in os.listdir('/proc/self/fd')]\nfor fd in fds:\n    try:\n"
                              "        os.fstat(fd)\n    except OSError:\n        continue\n    if fd > 2:\n"
                              "        print('ESCAPED', fd, os.readlink(f'/proc/self/fd/{fd}'))", {""}),
    # --- network ---
    "tcp to the host": ("s = socket.socket()\ns.settimeout(1)\ntry:\n    s.connect(('127.0.0.1', PORT))\n"
                        "    print('ESCAPED')\nexcept OSError:\n    pass", {""}),
    "abstract unix socket": ("s = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect('\\0ABSTRACT')\n"
                             "    print('ESCAPED')\nexcept OSError:\n    pass", {""}),
    "raw, packet and udp sockets": (
        "for args in ((socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP), (socket.AF_PACKET, socket.SOCK_RAW, "
        "0)):\n    try:\n        socket.socket(*args)\n        print('ESCAPED', args)\n    except OSError:\n"
        "        pass\ntry:\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('1.1.1.1', 53))\n"
        "    print('ESCAPED udp')\nexcept OSError:\n    pass", {""}),
    # --- privilege ---
    "setuid calls": ("for call in (lambda: os.setuid(0), lambda: os.setgid(0), lambda: os.setgroups([0]), "
                     "lambda: os.seteuid(0)):\n    try:\n        call()\n        print('ESCAPED')\n"
                     "    except OSError:\n        pass\nif os.geteuid() == 0:\n    print('ESCAPED root')", {""}),
    "setuid binary": ("r = subprocess.run(['/usr/bin/mount', '-t', 'tmpfs', 'none', '/tmp'], capture_output=True)\n"
                      "if r.returncode == 0:\n    print('ESCAPED')", {""}),
    "ptrace": ("for pid in (WORKER, 1):\n    if libc.ptrace(16, pid, None, None) == 0:\n"
               "        print('ESCAPED', pid)", {""}),
    "new namespaces and mounts": (
        "for flags in (0x10000000, 0x10020000, 0x00020000, 0x08000000):\n    if libc.unshare(flags) == 0:\n"
        "        print('ESCAPED', hex(flags))\nif libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0:\n"
        "    print('ESCAPED mount')\nif libc.umount2(b'/work', 2) == 0:\n    print('ESCAPED umount')\n"
        "r = subprocess.run(['unshare', '-Ur', 'true'], capture_output=True)\nif r.returncode == 0:\n"
        "    print('ESCAPED unshare')", {""}),
    "cgroup, sysctl and hostname writes": (
        "for p in ('/sys/fs/cgroup/memory/cgroup.procs', '/sys/fs/cgroup/pids/cgroup.procs', "
        "'/proc/sys/kernel/hostname', '/proc/sysrq-trigger', '/proc/self/oom_score_adj'):\n    try:\n"
        "        with open(p, 'w') as f:\n            f.write('-1000' if 'oom' in p else str(os.getpid()))\n"
        "        print('ESCAPED', p)\n    except OSError:\n        pass\n"
        "if libc.sethostname(b'pwned', 5) == 0:\n    print('ESCAPED hostname')", {""}),
    "host devices": ("for p in ('/dev/kmsg', '/dev/fuse', '/dev/ptmx', '/dev/nvidia0', '/dev/nvidiactl', '/dev/kfd', "
                     "'/dev/dri/card0', '/dev/vda', '/dev/sda', '/dev/mem', '/dev/tty'):\n    try:\n"
                     "        open(p, 'rb').close()\n        print('ESCAPED', p)\n    except OSError:\n        pass\n"
                     "if sorted(os.listdir('/dev')) != ['fd', 'full', 'null', 'random', 'shm', 'stderr', 'stdin', "
                     "'stdout', 'urandom', 'zero']:\n    print('ESCAPED', os.listdir('/dev'))", {""}),
    "segfault": ("ctypes.string_at(0)", {"signal 11"}),
    "abort with core": ("os.abort()", {"signal 6"}),
    "too many open files": ("fs = []\ntry:\n    while True:\n        fs.append(open('/dev/null'))\nexcept OSError:\n"
                            "    pass\nprint('ESCAPED' if len(fs) > 64 else 'held at', len(fs))", {""}),
}


@pytest.fixture(scope="module")
def host():
    """A live TCP port and abstract unix socket on the host, and the worker's secret env var."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(16)
    unix = socket.socket(socket.AF_UNIX)
    name = f"{TAG}-{os.getpid()}"
    unix.bind("\0" + name)
    unix.listen(16)
    os.environ["FACTORY_HOSTILE_SECRET"] = SECRET
    require_sandbox()
    yield {"PORT": str(tcp.getsockname()[1]), "ABSTRACT": name}
    os.environ.pop("FACTORY_HOSTILE_SECRET", None)
    tcp.close()
    unix.close()


def program(name: str, host: dict[str, str]) -> str:
    code = CASES[name][0]
    for key, value in {**host, "WORKER": str(os.getpid()), "TAG": TAG, "PROJECT": PROJECT_FILE,
                       "SECRET": SECRET}.items():
        code = code.replace(key, value)
    return PRELUDE + code


def own_uid(uid: int) -> bool:
    """A uid this test process's sandbox runs use (factory.sandbox._sandbox_uid)."""
    low = UID_BASE + ((os.getpid() & 0x3FFFFF) << 6)
    return low <= uid < low + 64


def leftovers() -> list[str]:
    """What this process's sandbox runs left on the host."""
    found = []
    for kind in ("shm", "sem", "msg"):
        for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[0]) >> 16 == 0x5A5A or own_uid(int(fields[7 if kind == "shm" else 4])):
                found.append(f"sysv {kind} {line.strip()}")
    for directory in ("/tmp", "/dev/shm", "/var/tmp"):
        for entry in os.scandir(directory):
            try:
                ours = own_uid(entry.stat(follow_symlinks=False).st_uid)
                if ours or TAG in entry.name and entry.name != f"{TAG}-{os.getpid()}":
                    found.append(entry.path)
            except FileNotFoundError:
                pass
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and own_uid(entry.stat().st_uid):
                status = dict(line.split(":\t", 1) for line in Path(entry.path, "status").read_text().splitlines()
                              if ":\t" in line)
                found.append(f"process {entry.name} ({status.get('Name')}, {status.get('State')}, parent "
                             f"{status.get('PPid')}): {Path(entry.path, 'cmdline').read_bytes()[:80]!r}")
        except OSError:
            pass
    version, where = cgroup_support()
    for parent in where.split(", ") if version else []:
        found += [str(p) for p in Path(parent).glob(f"{PREFIX}{os.getpid()}-*")]
    return found


def test_the_suite_has_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_submission_is_contained(name, host):
    started = time.monotonic()
    result = run_python(program(name, host), limits=LIMITS)
    took = time.monotonic() - started
    allowed = CASES[name][1]
    assert "ESCAPED" not in result.stdout, (name, result.stdout[-500:], result.stderr[-500:])
    assert allowed is None or result.reason in allowed, (name, result.reason, result.stderr[-800:])
    assert took < LIMITS.wall_s + 3, took
    assert leftovers() == []
    assert run_python("print(6 * 7)", limits=LIMITS).stdout == "42\n"  # the worker still runs submissions


def test_an_earlier_submission_leaves_nothing_for_a_later_one(host):
    """SysV segments, /dev/shm files and /tmp files of one run are gone for the next (and never on the host)."""
    first = run_python(program("sysv shm pinned", host) + "\nopen('/dev/shm/TAG-note', 'w').write('secret')\n"
                       "open('TAG-note', 'w').write('secret')".replace("TAG", TAG), limits=LIMITS)
    assert first.ok and "segment" in first.stdout, first.stderr
    second = run_python(PRELUDE + "print(libc.shmget(0x5A5A0001, 0, 0), os.listdir('/dev/shm'), os.listdir('.'))",
                        limits=LIMITS)
    assert second.ok and second.stdout.startswith("-1 [] ['main.py']"), second.stdout
    assert leftovers() == []


def test_memory_cap_is_for_the_whole_submission(host):
    """Six processes of 60 MB under a 128 MB cap: with a cgroup the total is held, not each process alone."""
    if not cgroup_support()[0]:
        pytest.skip(f"no cgroup on this host ({cgroup_support()[1]}): the cap is per process here")
    result = run_python(program("many processes x memory", host), limits=LIMITS)
    assert "held" in result.stdout or result.reason in ("memory", "signal 9"), (result.stdout, result.reason)
    assert result.isolation["memory_peak_mb"] <= LIMITS.memory_mb + 1


@pytest.mark.parametrize("name", ["tcp to the host", "abstract unix socket", "reads env vars", "reads host /proc"])
def test_the_escape_markers_fire_without_the_sandbox(name, host, tmp_path):
    """Control: the same programs run as a plain subprocess do get out, so the marker can catch an escape."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", program(name, host)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=30, check=False)
    assert "ESCAPED" in done.stdout, (done.stdout, done.stderr)


def test_a_process_killed_for_memory_fails_the_run_even_when_the_rest_exits_0(host):
    """The kernel's OOM killer may pick any process of the submission; the run is over its cap all the same."""
    if not cgroup_support()[0]:
        pytest.skip(f"no cgroup on this host ({cgroup_support()[1]}): the cap is per process here")
    code = ("import os, time\npids = []\nfor _ in range(3):\n    pid = os.fork()\n    if pid == 0:\n"
            "        x = b'x' * (CHILD_MB << 20)\n        time.sleep(0.5)\n        os._exit(0)\n    pids.append(pid)\n"
            "for pid in pids:\n    os.waitpid(pid, 0)\nprint('parent exits 0')").replace("CHILD_MB", str(LIMITS.memory_mb // 2))
    result = run_python(code, limits=LIMITS)
    assert result.reason == "memory" and not result.ok, (result.returncode, result.reason, result.stdout)
