"""Fault injection at the store's write points: fail one call with ENOSPC or EIO, or give the store a byte quota.

The store does its I/O through `factory.store.os`, `factory.store.open` (the
Parquet temporary file and run files) and `factory.commit_log.os` (the commit
log and directory fsyncs); `inject` swaps those for proxies, so only the
store's own calls fail, never the test's or pytest's.

Write points (`POINTS`):
  shard-write   a write to a shard's temporary file          shard-fsync  its fsync
  dir-fsync     fsync of the shards directory                 log-write    the commit record's write (half is written)
  log-fsync     fsync of the commit log                       log-undo     log-write, and taking it back fails too
  rename        the rename of a committed shard into place    run-file     a write of a run file (stats, config)
"""

from __future__ import annotations

import builtins
import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import factory.commit_log as commit_log_module
import factory.store as store_module

POINTS = ["shard-write", "shard-fsync", "dir-fsync", "log-write", "log-fsync", "log-undo", "rename", "run-file"]


@dataclass
class Plan:
    """Fail the `nth` call of `point` (and, with `times`, the following ones) with `errno_`; or, with
    `quota`, fail every write once that many bytes were written (ENOSPC, partial writes included)."""

    point: str | None = None
    errno_: int = errno.ENOSPC
    nth: int = 1
    times: int = 1
    quota: int | None = None
    quota_on: tuple[str, ...] = ("shard-write", "run-file", "log-write")
    """Write points whose bytes count against the quota."""
    armed: bool = True
    calls: dict[str, int] = field(default_factory=dict)
    fired: int = 0
    undo_failed: bool = False

    def hit(self, point: str) -> bool:
        if not self.armed or point != self.point:
            return False
        self.calls[point] = self.calls.get(point, 0) + 1
        if self.nth <= self.calls[point] < self.nth + self.times:
            self.fired += 1
            return True
        return False

    def fail(self, what: str) -> OSError:
        return OSError(self.errno_, os.strerror(self.errno_), what)

    def spend(self, size: int, point: str) -> int:
        """How many of `size` bytes fit in the quota (all, without one)."""
        if self.quota is None or not self.armed or point not in self.quota_on:
            return size
        allowed = max(0, min(size, self.quota))
        self.quota -= allowed
        return allowed


class _Proxy:
    def __init__(self, real: Any, hooks: dict[str, Any]) -> None:
        self._real, self._hooks = real, hooks

    def __getattr__(self, name: str) -> Any:
        return self._hooks.get(name) or getattr(self._real, name)


class _FailingFile:
    """A file whose writes fail as the plan says (a shard's temporary file, or a run file)."""

    def __init__(self, handle: Any, plan: Plan, point: str) -> None:
        self._handle, self._plan, self._point = handle, plan, point

    def write(self, data: Any) -> int:
        if self._plan.hit(self._point):
            raise self._plan.fail(self._handle.name)
        size = len(memoryview(data).cast("B")) if not isinstance(data, str) else len(data.encode())
        allowed = self._plan.spend(size, self._point)
        if allowed < size:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._handle.name)
        return self._handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> _FailingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.close()


@contextmanager
def inject(plan: Plan) -> Iterator[Plan]:
    """Run the block with the store's I/O failing as `plan` says."""
    real_open = builtins.open

    def store_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(path, mode, *args, **kwargs)
        if "w" not in mode and "a" not in mode:
            return handle
        name = os.path.basename(os.fspath(path))
        point = "shard-write" if ".parquet." in name and name.endswith(".tmp") else "run-file"
        return _FailingFile(handle, plan, point)

    def store_fsync(fd: int) -> None:
        if plan.hit("shard-fsync"):
            raise plan.fail(f"fd {fd}")
        os.fsync(fd)

    def store_replace(src: Any, dst: Any) -> None:
        if plan.hit("rename"):
            raise plan.fail(os.fspath(dst))
        os.replace(src, dst)

    def log_write(fd: int, data: bytes) -> int:
        if plan.hit("log-write") or plan.hit("log-undo"):
            half = len(data) // 2
            os.write(fd, data[:half])  # a torn record, as a full disk leaves it
            raise plan.fail(f"fd {fd}")
        allowed = plan.spend(len(data), "log-write")
        if allowed < len(data):
            return os.write(fd, data[:allowed]) if allowed else _raise(plan.fail(f"fd {fd}"))
        return os.write(fd, data)

    def log_fsync(fd: int) -> None:
        point = "dir-fsync" if stat.S_ISDIR(os.fstat(fd).st_mode) else "log-fsync"
        if plan.hit(point):
            raise plan.fail(f"fd {fd}")
        os.fsync(fd)

    def log_ftruncate(fd: int, length: int) -> None:
        if plan.point == "log-undo" and plan.fired and plan.armed and not plan.undo_failed:
            plan.undo_failed = True
            raise plan.fail(f"fd {fd}")
        os.ftruncate(fd, length)

    saved = (store_module.os, getattr(store_module, "open", None), commit_log_module.os)
    store_module.os = _Proxy(os, {"fsync": store_fsync, "replace": store_replace})
    store_module.open = store_open  # type: ignore[attr-defined]
    commit_log_module.os = _Proxy(os, {"write": log_write, "fsync": log_fsync, "ftruncate": log_ftruncate})
    try:
        yield plan
    finally:
        store_module.os, commit_log_module.os = saved[0], saved[2]
        if saved[1] is None:
            del store_module.open
        else:
            store_module.open = saved[1]


def _raise(error: OSError) -> int:
    raise error
