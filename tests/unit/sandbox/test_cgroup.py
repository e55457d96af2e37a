"""Which control group a sandbox run gets: v2 where the worker's cgroup can delegate memory and pids, else the v1
hierarchies, else none (and the summary says the fallback). The v2 and v1 wiring is checked on a fake cgroup
tree; the real one of this host is exercised by test_hostile.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import factory.sandbox_cgroup as cg
from factory.sandbox import SandboxLimits, memory_limit_summary


@pytest.fixture
def fake(monkeypatch, tmp_path):
    def use(mounts: list[tuple[str, str, set[str]]], own: dict[str, str]) -> None:
        monkeypatch.setattr(cg, "_mounts", lambda: mounts)
        monkeypatch.setattr(cg, "_own_paths", lambda: own)
        monkeypatch.setattr(cg, "_support", None)

    yield use
    cg._support = None


def test_v2_where_the_workers_cgroup_delegates_memory_and_pids(fake, tmp_path):
    base = tmp_path / "unified" / "worker.slice"
    base.mkdir(parents=True)
    (base / "cgroup.controllers").write_text("cpu memory pids io\n")
    (base / "cgroup.subtree_control").write_text("")
    fake([(str(tmp_path / "unified"), "cgroup2", {"rw"})], {"": "/worker.slice"})
    assert cg.cgroup_support() == (2, str(base))
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids"  # enabled for the children
    group = cg.create_cgroup("123-0", memory_mb=64, processes=9)
    assert group is not None and group.version == 2
    assert group.procs_files == [str(base / f"{cg.PREFIX}123-0/cgroup.procs")]
    made = base / f"{cg.PREFIX}123-0"
    assert (made / "memory.max").read_text() == str(64 << 20) and (made / "pids.max").read_text() == "9"
    assert (made / "memory.swap.max").read_text() == "0"
    (made / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (made / "memory.peak").write_text(str(50 << 20))
    assert group.oom_kills() == 1 and group.hit_memory_cap() and group.peak_mb() == 50.0
    assert "cgroup v2: 256 MB and 16 processes for the whole submission" in memory_limit_summary(SandboxLimits())


def test_v1_hierarchies_when_v2_has_no_memory_controller(fake, tmp_path):
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("hugetlb\n")
    for name in ("memory", "pids"):
        (tmp_path / name / "job").mkdir(parents=True)
    fake([(str(unified), "cgroup2", set()), (str(tmp_path / "memory"), "cgroup", {"rw", "memory"}),
          (str(tmp_path / "pids"), "cgroup", {"rw", "pids"})], {"": "/", "memory": "/job", "pids": "/job"})
    version, where = cg.cgroup_support()
    assert version == 1 and where == f"{tmp_path / 'memory' / 'job'}, {tmp_path / 'pids' / 'job'}"
    group = cg.create_cgroup("5-1", memory_mb=32, processes=4)
    memory, pids = group.dirs
    assert (memory / "memory.limit_in_bytes").read_text() == str(32 << 20) and (pids / "pids.max").read_text() == "4"
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert group.oom_kills() == 2


def test_no_cgroup_falls_back_per_process_and_says_so(fake):
    fake([], {"": "/"})
    assert cg.cgroup_support()[0] == 0 and cg.create_cgroup("1-0", memory_mb=32, processes=4) is None
    summary = memory_limit_summary(SandboxLimits(memory_mb=100, processes=4))
    assert summary.startswith("no cgroup (no cgroup2 mount; no cgroup v1 memory hierarchy)")
    assert "per process 100 MB of address space x at most 4 processes (400 MB in all)" in summary


def test_this_hosts_cgroup_is_found_when_running_as_root():
    """As root on a kernel with the memory and pids controllers (CI's machines), a group can be made."""
    enabled = {line.split()[0] for line in Path("/proc/cgroups").read_text().splitlines()[1:]
               if line.split()[-1] == "1"} if Path("/proc/cgroups").is_file() else set()
    if os.geteuid() != 0 or not {"memory", "pids"} <= enabled:
        pytest.skip(f"not root, or the kernel has no memory/pids controllers ({sorted(enabled)})")
    cg._support = None
    version, where = cg.cgroup_support()
    assert version in (1, 2), where
