"""One control group per sandbox run: a memory cap and a process cap for the whole submission, not per process.

    group = create_cgroup("sandbox-123-0", memory_mb=256, processes=16)   # None where no cgroup is delegated
    ... the launcher writes its pid into each of group.procs_files ...
    group.oom_kills(), group.peak_mb(); group.destroy()

cgroup v2 is used where this process's own cgroup can hand `memory` and `pids` to a child (root, or a systemd
`Delegate=yes` unit); otherwise the v1 `memory` and `pids` hierarchies where they are mounted and writable
(hybrid hosts such as this project's machines). `cgroup_support()` says which one, or why none, once per process.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "factory-sandbox-"


@dataclass
class Cgroup:
    """A created group: its directories (one for v2; memory and pids for v1) and the files that take a pid."""

    version: int
    dirs: list[Path]

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def _value(self, name: str) -> str:
        for d in self.dirs:
            if (d / name).is_file():
                try:
                    return (d / name).read_text()
                except OSError:
                    return ""
        return ""

    def oom_kills(self) -> int:
        """How many processes the kernel killed because the group reached its memory cap."""
        text = self._value("memory.events" if self.version == 2 else "memory.oom_control")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def hit_memory_cap(self) -> bool:
        """The group reached its memory cap at least once (an allocation failed or a process was killed)."""
        if self.oom_kills():
            return True
        if self.version == 1:
            return int(self._value("memory.failcnt") or 0) > 0
        events = dict(line.split(" ", 1) for line in self._value("memory.events").splitlines() if " " in line)
        return int(events.get("max", 0)) > 0

    def peak_mb(self) -> float:
        value = self._value("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes").strip()
        return round(int(value) / (1 << 20), 1) if value.isdigit() else 0.0

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL every process in the group (its counters stay readable until `destroy`)."""
        for d in self.dirs:
            if (d / "cgroup.kill").is_file():
                try:
                    (d / "cgroup.kill").write_text("1")
                except OSError:
                    pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def destroy(self, timeout_s: float = 5.0) -> None:
        """Kill every process still in the group and remove it (retried while the kernel reaps them)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.kill()
            left = []
            for d in self.dirs:
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(d)
            self.dirs = left
            if not left or time.monotonic() > deadline:
                return
            time.sleep(0.01)


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    found = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            fields = line.split()
            dash = fields.index("-")
            fstype, options = fields[dash + 1], set(fields[dash + 3].split(","))
            if fstype in ("cgroup", "cgroup2"):
                found.append((fields[4], fstype, options))
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per controller ('' for the v2 unified one)."""
    paths = {}
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def _v2_parent() -> tuple[Path | None, str]:
    mounts = [m for m in _mounts() if m[1] == "cgroup2"]
    if not mounts:
        return None, "no cgroup2 mount"
    base = Path(mounts[0][0]) / _own_paths().get("", "/").lstrip("/")
    try:
        available = set((base / "cgroup.controllers").read_text().split())
    except OSError as error:
        return None, f"cgroup2 at {base}: {error.strerror}"
    if not {"memory", "pids"} <= available:
        return None, f"cgroup2 at {base} offers {sorted(available) or 'no controllers'}, not memory and pids"
    enabled = set((base / "cgroup.subtree_control").read_text().split())
    if not {"memory", "pids"} <= enabled:
        try:
            (base / "cgroup.subtree_control").write_text("+memory +pids")
        except OSError as error:
            return None, f"cgroup2 at {base}: cannot enable memory and pids for children ({error.strerror})"
    if not os.access(base, os.W_OK):
        return None, f"cgroup2 at {base} is not writable"
    return base, ""


def _v1_parents() -> tuple[dict[str, Path], str]:
    own = _own_paths()
    parents = {}
    for controller in ("memory", "pids"):
        mount = next((m for m in _mounts() if m[1] == "cgroup" and controller in m[2]), None)
        if mount is None:
            return {}, f"no cgroup v1 {controller} hierarchy"
        base = Path(mount[0]) / own.get(controller, "/").lstrip("/")
        if not os.access(base, os.W_OK):
            return {}, f"cgroup v1 {controller} at {base} is not writable"
        parents[controller] = base
    return parents, ""


_support: tuple[int, str] | None = None


def cgroup_support() -> tuple[int, str]:
    """(2 or 1, where) when this process can create capped groups, else (0, why not); probed once."""
    global _support
    if _support is None:
        v2, why2 = _v2_parent()
        if v2 is not None:
            _support = (2, str(v2))
        else:
            v1, why1 = _v1_parents()
            _support = (1, ", ".join(str(p) for p in v1.values())) if v1 else (0, f"{why2}; {why1}")
    return _support


def create_cgroup(name: str, *, memory_mb: int, processes: int) -> Cgroup | None:
    """A new group capped at `memory_mb` (no swap on top) and `processes` tasks, or None where none can be made."""
    version, _ = cgroup_support()
    if version == 2:
        parent, _ = _v2_parent()
        group = Cgroup(2, [_mkdir(parent / (PREFIX + name))])
        _write(group.dirs[0], {"memory.max": memory_mb << 20, "memory.swap.max": 0, "pids.max": processes})
        return group
    if version == 1:
        parents, _ = _v1_parents()
        memory, pids = _mkdir(parents["memory"] / (PREFIX + name)), _mkdir(parents["pids"] / (PREFIX + name))
        group = Cgroup(1, [memory, pids])
        _write(memory, {"memory.limit_in_bytes": memory_mb << 20, "memory.memsw.limit_in_bytes": memory_mb << 20})
        _write(pids, {"pids.max": processes})
        return group
    return None


def remove_stale_cgroups() -> int:
    """Remove groups left by sandbox workers that died (their creator's pid is gone); returns how many."""
    version, _ = cgroup_support()
    parents = [_v2_parent()[0]] if version == 2 else list(_v1_parents()[0].values()) if version == 1 else []
    removed = 0
    for parent in parents:
        for entry in parent.glob(PREFIX + "*"):
            creator = entry.name[len(PREFIX):].split("-")[0]
            if creator.isdigit() and not Path(f"/proc/{creator}").exists():
                Cgroup(version, [entry]).destroy(timeout_s=1)
                removed += 1
    return removed


def _mkdir(path: Path) -> Path:
    try:
        path.mkdir()
    except FileExistsError:  # a pid reused after a crash: start from an empty group
        Cgroup(0, [path]).destroy(timeout_s=1)
        path.mkdir()
    return path


def _write(directory: Path, values: dict[str, int]) -> None:
    for name, value in values.items():
        try:
            (directory / name).write_text(str(value))
        except FileNotFoundError:  # memsw / swap.max only exist where swap accounting is compiled in
            continue
        except OSError as error:
            if error.errno != errno.EINVAL or not name.startswith(("memory.memsw", "memory.swap")):
                raise
