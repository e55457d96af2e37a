"""The sandbox's first process: joins its cgroup, isolates itself, drops privileges, sets limits, execs the program.

Run by `factory.sandbox` as `python -I -S sandbox_launcher.py CONFIG_JSON` (so it imports nothing from the
project and nothing from site-packages), as root, or as any user where unprivileged user namespaces are allowed
(`userns`: a new user namespace first, in which the caller's own uid is the only one and the program's).
Steps; a report file the caller owns says which were done, and any step that fails stops the run (exit 125
with the reason in the report) rather than running unconfined:

1. join the run's control group(s) (memory and process caps for the whole submission; `factory.sandbox_cgroup`);
2. new mount, PID, network, IPC, UTS and cgroup namespaces (`unshare`), then fork a PID 1 (init) for the new
   PID namespace, which forks the program and reaps: when the program exits, init exits with its status and
   the kernel kills every process left in the namespace; its SysV/POSIX IPC objects die with the IPC namespace;
3. in the mount namespace: every mount read-only and nosuid; a minimal read-only /dev (null, zero, full,
   random, urandom; no GPUs, fuse, kmsg or ptys); one private tmpfs capped at `disk_mb` (and
   `inodes` files) as the only writable place, seen at /tmp (the cwd, holding the program's files) and at
   /dev/shm; empty read-only mounts over the paths to hide (the project, /root, /home, ...); a fresh /proc that
   shows only the sandbox's processes;
4. rlimits (CPU seconds, address space, processes, file size, open files, no core dumps), no-new-privileges
   (setuid binaries do not elevate), an unprivileged uid/gid (as root: one of its own per run, with no
   supplementary groups), no capabilities, and a seccomp filter (see DENIED);
5. exec the program with a minimal environment.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
NAMESPACES = {"mount": CLONE_NEWNS, "pid": CLONE_NEWPID, "network": CLONE_NEWNET, "ipc": CLONE_NEWIPC,
              "uts": CLONE_NEWUTS, "cgroup": CLONE_NEWCGROUP}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 4096, 8192, 16384, 1 << 18
DEVICES = ("null", "zero", "full", "random", "urandom")
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
PR_SET_NO_NEW_PRIVS, PR_SET_DUMPABLE = 38, 4
REFUSED = 125


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _check(libc, result, what):
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def _mount(libc, source, target, fstype, flags, data=None):
    _check(libc, libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                            data and data.encode()), f"mount {target}")


def _read_only_everywhere(libc):
    """Every mount of this namespace read-only and nosuid: one mount_setattr call (Linux >= 5.12), else each."""
    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)) == 0:
        return "mount_setattr"
    with open("/proc/self/mountinfo") as handle:
        points = [line.split()[4].encode().decode("unicode_escape") for line in handle]
    for point in points:
        options = os.statvfs(point).f_flag if os.path.exists(point) else 0
        keep = options & (MS_NODEV | MS_NOEXEC)  # ST_NODEV/ST_NOEXEC have the MS_ values
        if libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | keep, None) != 0:
            _check(libc, -1, f"remount {point} read-only")
    return "remount"


def _minimal_dev(libc):
    """A /dev of its own, read-only: the harmless devices (DEVICES, bound from the host), the fd symlinks and a
    mount point for /dev/shm; no GPUs, fuse, kmsg, ptys or disks. Built on /tmp (still the host's) then moved."""
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(f"/tmp/{name}", "w").close()
            _mount(libc, f"/dev/{name}", f"/tmp/{name}", None, MS_BIND)
    os.mkdir("/tmp/shm")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/tmp/{name}")
    _mount(libc, None, "/tmp", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    _mount(libc, "/tmp", "/dev", None, MS_MOVE)


def _isolate_filesystem(libc, config, files):
    uid, limits = config["uid"], config["limits"]
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    how = _read_only_everywhere(libc)
    _minimal_dev(libc)
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={limits['disk_mb']}m,nr_inodes={limits['inodes']},mode=0755")
    for sub in ("work", "shm"):
        os.mkdir(f"/tmp/{sub}", 0o700 if sub == "work" else 0o1777)
        os.chown(f"/tmp/{sub}", uid, uid)
    _mount(libc, "/tmp/shm", "/dev/shm", None, MS_BIND)
    _mount(libc, "/tmp/work", "/tmp", None, MS_BIND)
    for name, data in files.items():
        path = os.path.join("/tmp", name)
        with open(path, "wb") as handle:
            handle.write(data)
        os.chown(path, uid, uid)
    for path in config["hide"]:
        if os.path.isdir(path):
            _mount(libc, "tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    return how


# seccomp: calls a submission never needs and that would let it build its own namespaces (a user namespace
# gives it CAP_SYS_ADMIN there, and with it tmpfs mounts outside the disk cap) or reach kernel surfaces.
# x86_64 numbers; other architectures run without the filter and the report says so.
AUDIT_ARCH_X86_64, X32_BIT = 0xC000003E, 0x40000000
DENIED = {"unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
          "add_key": 248, "request_key": 249, "keyctl": 250, "bpf": 321, "userfaultfd": 323,
          "perf_event_open": 298, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
          "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
          "mount_setattr": 442, "kexec_load": 246, "init_module": 175, "finit_module": 313}
SYS_CLONE, SYS_CLONE3 = 56, 435
CLONE_NEW_ANY = 0x7E020080  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
EPERM, ENOSYS = 1, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


def _seccomp(libc):
    """Deny the calls in DENIED (EPERM), clone with a CLONE_NEW* flag (EPERM) and clone3 (ENOSYS: libc then
    falls back to clone); kill a process that uses another ABI (x32, 32-bit) to get around the numbers."""
    import platform

    if platform.machine() != "x86_64":
        return f"none (no filter for {platform.machine()})"
    ld_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    prog = [(ld_abs, 0, 0, 4), (jeq, 1, 0, AUDIT_ARCH_X86_64), (ret, 0, 0, RET_KILL_PROCESS), (ld_abs, 0, 0, 0),
            (jge, 0, 1, X32_BIT), (ret, 0, 0, RET_KILL_PROCESS)]
    for number in DENIED.values():
        prog += [(jeq, 0, 1, number), (ret, 0, 0, RET_ERRNO | EPERM)]
    prog += [(jeq, 0, 1, SYS_CLONE3), (ret, 0, 0, RET_ERRNO | ENOSYS),
             (jeq, 0, 3, SYS_CLONE), (ld_abs, 0, 0, 16), (jset, 0, 1, CLONE_NEW_ANY), (ret, 0, 0, RET_ERRNO | EPERM),
             (ret, 0, 0, RET_ALLOW)]
    filters = (SockFilter * len(prog))(*[SockFilter(*x) for x in prog])
    program = SockFprog(len(prog), filters)
    _check(libc, libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0), "seccomp filter")
    return f"denies {len(DENIED)} calls and namespace-creating clones"


def _limit(limits):
    def both(kind, value):
        resource.setrlimit(kind, (value, value))

    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    both(resource.RLIMIT_AS, limits["memory_mb"] << 20)
    both(resource.RLIMIT_NPROC, limits["processes"])
    both(resource.RLIMIT_FSIZE, limits["file_mb"] << 20)
    both(resource.RLIMIT_NOFILE, limits["open_files"])
    both(resource.RLIMIT_CORE, 0)
    both(resource.RLIMIT_MSGQUEUE, 0)


def _refuse(report, report_file, error):
    report["error"] = str(error)
    json.dump(report, report_file)
    report_file.close()
    os._exit(REFUSED)


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities(libc):
    """No capabilities left in any set (capset v3: two 32-bit words of each)."""
    data = (CapData * 2)()
    _check(libc, libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), data), "capset")


def _wait_and_exit(child, report_file, libc, drop_capabilities=False):
    """In the parent: wait for `child` and exit with its status (a signal N as 128 + N); the child returns."""
    if child == 0:
        return
    report_file.close()
    if drop_capabilities:  # init: nothing the program could borrow, and not attachable with ptrace
        _check(libc, libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
        _drop_capabilities(libc)
        _check(libc, libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        _seccomp(libc)
    while True:
        pid, status = os.wait()  # as init, also reaps the orphans the program leaves
        if pid == child:
            break
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def main():
    config = json.loads(sys.argv[1])
    report = {"namespaces": [], "filesystem": False, "uid": config["uid"]}
    libc = ctypes.CDLL(None, use_errno=True)
    report_file = open(config["report"], "w")  # opened now: the mount namespace hides its directory later
    files = {}
    for entry in os.scandir(config["dir"]):  # read now: the private /tmp replaces the host's
        with open(entry.path, "rb") as handle:
            files[entry.name] = handle.read()
    userns = config.get("userns", False)
    names = [*NAMESPACES, "user"] if userns else list(NAMESPACES)
    try:
        for procs in config["cgroup"]:
            with open(procs, "w") as handle:
                handle.write(str(os.getpid()))
        flags = CLONE_NEWUSER if userns else 0
        for flag in NAMESPACES.values():
            flags |= flag
        outer_uid, outer_gid = os.getuid(), os.getgid()
        _check(libc, libc.unshare(flags), "unshare(" + ", ".join(names) + ")")
        if userns:  # the caller's uid/gid appear as config["uid"] inside; no other id exists there
            for name, text in (("setgroups", "deny"), ("uid_map", f"{config['uid']} {outer_uid} 1"),
                               ("gid_map", f"{config['uid']} {outer_gid} 1")):
                with open(f"/proc/self/{name}", "w") as handle:
                    handle.write(text)
    except OSError as error:
        _refuse(report, report_file, error)
    report["namespaces"] = names
    _wait_and_exit(os.fork(), report_file, libc)  # the child is PID 1 (init) of the new PID namespace
    try:
        report["read_only"] = _isolate_filesystem(libc, config, files)
        report["filesystem"] = True
        _check(libc, libc.sethostname(b"sandbox", 7), "sethostname")
    except OSError as error:
        _refuse(report, report_file, error)
    # init only reaps (without capabilities); the program is its child, so it gets ordinary signal semantics
    # (init ignores signals it has no handler for: abort() would end in SIGSEGV) and cannot signal its init
    _wait_and_exit(os.fork(), report_file, libc, drop_capabilities=True)
    try:
        os.chdir("/tmp")
        _limit(config["limits"])
        _check(libc, libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        uid = config["uid"]
        if not userns:  # in a user namespace the one mapped id is already ours, and setgroups is denied
            os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        _drop_capabilities(libc)  # root to uid drops them anyway; in a user namespace this does
        report["seccomp"] = _seccomp(libc)
    except OSError as error:
        _refuse(report, report_file, error)
    with report_file:
        json.dump(report, report_file)
    os.execve(config["argv"][0], config["argv"], config["env"])


if __name__ == "__main__":
    main()
