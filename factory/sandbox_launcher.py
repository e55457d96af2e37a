"""The sandbox's first process: isolates itself, drops privileges, sets limits, then execs the untrusted program.

Run by `factory.sandbox` as `python -I -S sandbox_launcher.py CONFIG_JSON` (so it imports nothing from the
project and nothing from site-packages). Steps, each reported in a report file the caller owns so the caller knows what isolation it actually got:

1. new network, mount and PID namespaces (`unshare`, needs root or CAP_SYS_ADMIN); then fork so the program
   is PID 1 of its own PID namespace: when it exits, the kernel kills every process it left behind;
2. in the mount namespace: the sandbox directory bound onto /tmp (its cwd), read-only empty tmpfs over the
   paths to hide (the project, /root, /home, ...), a fresh /proc that shows only the sandbox's processes;
3. rlimits (CPU seconds, address space, processes, file size, open files, no core dumps);
4. when root: drop to an unprivileged uid/gid of its own with no supplementary groups;
5. exec the program with a minimal environment.

Without namespaces (no privilege) steps 1-2 are skipped and reported; the caller then blocks sockets inside
Python only, which is weaker, and says so.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount(libc, source, target, fstype, flags, data=None):
    if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                  data and data.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")


def _isolate_filesystem(libc, workdir, hide):
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, workdir, "/tmp", None, MS_BIND | MS_REC)
    for path in hide:
        if os.path.isdir(path):
            _mount(libc, "tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _limit(limits):
    def both(kind, value):
        resource.setrlimit(kind, (value, value))

    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    both(resource.RLIMIT_AS, limits["memory_mb"] << 20)
    both(resource.RLIMIT_NPROC, limits["processes"])
    both(resource.RLIMIT_FSIZE, limits["file_mb"] << 20)
    both(resource.RLIMIT_NOFILE, limits["open_files"])
    both(resource.RLIMIT_CORE, 0)


def main():
    config = json.loads(sys.argv[1])
    report = {"namespaces": False, "filesystem": False, "uid": os.getuid()}
    libc = _libc()
    report_file = open(config["report"], "w")  # opened now: the mount namespace hides its directory later
    if config["namespaces"] and libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET) == 0:
        report["namespaces"] = True
    else:
        report["namespaces_error"] = os.strerror(ctypes.get_errno()) if config["namespaces"] else "off"
    if report["namespaces"]:
        child = os.fork()  # the child is PID 1 of the new PID namespace
        if child:
            _, status = os.waitpid(child, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
        try:
            _isolate_filesystem(libc, config["dir"], config["hide"])
            report["filesystem"] = True
            os.chdir("/tmp")
        except OSError as error:
            report["filesystem_error"] = str(error)
            os.chdir(config["dir"])
    else:
        os.chdir(config["dir"])
    with report_file:
        json.dump(report, report_file)
    _limit(config["limits"])
    if os.getuid() == 0:
        uid = config["uid"]
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.execve(config["argv"][0], config["argv"], config["env"])


if __name__ == "__main__":
    main()
