"""Idle recycling of `run-api`: once a burst of work is over, the process starts itself again in place.

What the first post loads (pyarrow, numpy, the Parquet writer's allocations) stays resident for the life of a
process: a service that has drained its queue sat at ~2x its idle RSS (bench/RESULTS.md, issue 29), and nothing
short of a new process image gives the pages of a loaded library back. So when the queue holds no batch, nothing is
in flight and nothing arrived for `recycle_idle_s`, run-api stops serving as at a SIGTERM (requests finish, pending
groups are committed, the served state is closed), then `exec`s itself with the same command line:

- the listening socket is kept open across the exec (its descriptor is inherited, named by LISTEN_FD_ENV), so
  connections that arrive meanwhile wait in the kernel's backlog and are answered by the new image; keep-alive
  connections with no request on them are closed, as any server's keep-alive timeout does;
- the pid stays the same (supervisors, `kill`, the Prefect flow that started it see one process);
- the new image starts "dormant" (DORMANT_ENV) where the runs' commit logs are as the old image left them and the
  served state has just the groups it handed over untaken (fewer than a batch): it answers /batch "no batch",
  /status and registrations without loading pyarrow or indexing a shard. The first post, a change in a followed
  commit log, a trainer that rewinds (a replay), /latest_example, /reset_data or a registration while it holds
  groups load them, as a first post after a start does (`BatchService.wake`).

A recycle costs ~0.7 s of CPU (0.5 s to stop and start again, 0.2 s for the next post to load pyarrow) and ~0.5 s
during which requests wait in the backlog. Steady traffic never looks quiet (the pause must be 4x its recent
longest), and there is at most one recycle per `recycle_min_interval_s` unless WORK_CPU_S of CPU were worked
since. A process that serves from inside another (`run_service`, the Prefect flow) never recycles.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LISTEN_FD_ENV = "FACTORY_SERVE_LISTEN_FD"
"""Descriptor of the listening socket a recycled run-api inherits (set only across its own exec)."""
DORMANT_ENV = "FACTORY_SERVE_DORMANT"
"""JSON of `BatchService.handover`: the commit logs the old image had indexed in full ({path: [size, mtime_ns,
inode] or null}) and the groups it left queued, fewer than a batch."""
RECYCLED_AT_ENV = "FACTORY_SERVE_RECYCLED_AT"
"""Wall-clock time and process CPU time of the last recycle ("wall cpu"), so the new image keeps the interval (the
kernel's CPU time of a process goes on across an exec)."""
WORK_CPU_S = 10.0
"""CPU seconds of work after which a recycle is allowed before recycle_min_interval_s: one costs ~0.7 s of CPU (a
start, and pyarrow loaded again by the next post), so recycles then cost at most ~7% of the work between them."""
HEAVY_MODULES = ("pyarrow", "numpy")
"""What a recycle gives back: if none of these is loaded there is nothing to return."""


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The socket run-api serves on: the one a recycle handed over (LISTEN_FD_ENV, taken out of the environment
    so that nothing this process starts inherits it), else a new one bound to (host, port)."""
    inherited = os.environ.pop(LISTEN_FD_ENV, None)
    if inherited is not None:
        sock = socket.socket(fileno=int(inherited))
        sock.set_inheritable(False)
        return sock
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def was_recycled() -> bool:
    """Whether this process is the new image of a recycle (checked before `listening_socket` takes the fd)."""
    return LISTEN_FD_ENV in os.environ


def log_stats(paths: Iterable[Path]) -> dict[str, list[int] | None]:
    """{path: [size, mtime_ns, inode]} of each commit log (None where there is none): what a dormant image
    compares to notice a commit made after the old image's last scan."""
    stats: dict[str, list[int] | None] = {}
    for path in paths:
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            stats[str(path)] = None
        else:
            stats[str(path)] = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
    return stats


def take_handover() -> dict[str, Any] | None:
    """What the old image handed over (DORMANT_ENV, taken out of the environment), if anything."""
    raw = os.environ.pop(DORMANT_ENV, None)
    if not raw:
        return None
    try:
        handover = json.loads(raw)
    except ValueError:
        return None
    return handover if isinstance(handover, dict) else None


def last_recycle_at() -> tuple[float, float] | None:
    """(wall-clock time, process CPU time) of this process's last recycle, if it had one."""
    try:
        wall, cpu = os.environ[RECYCLED_AT_ENV].split()
        return float(wall), float(cpu)
    except (KeyError, ValueError):
        return None


def heavy_modules_loaded(modules: Mapping[str, object] | None = None) -> bool:
    loaded = sys.modules if modules is None else modules
    return any(name in loaded for name in HEAVY_MODULES)


class RecyclePolicy:
    """When to recycle: plain numbers in, a yes or no out (the service says whether it is quiet, the server
    whether a request is in flight)."""

    def __init__(self, idle_s: float, min_interval_s: float, last_recycle: tuple[float, float] | None = None,
                 work_cpu_s: float = WORK_CPU_S) -> None:
        self.idle_s, self.min_interval_s, self.work_cpu_s = idle_s, min_interval_s, work_cpu_s
        self.last_recycle = last_recycle
        """(wall-clock time, process CPU time) of the last recycle."""

    @property
    def enabled(self) -> bool:
        return self.idle_s > 0

    def due(self, *, quiet: Callable[[], bool], requests_in_flight: int, heavy_loaded: bool,
            now: float | None = None, cpu_now: float | None = None) -> bool:
        """`quiet()`: the service has had no work for idle_s and has none now (`BatchService.quiet`); asked last,
        as it may look at the queue. Not twice within min_interval_s, unless the process has worked WORK_CPU_S of
        CPU since the last recycle."""
        if not self.enabled or not heavy_loaded or requests_in_flight:
            return False
        if self.last_recycle is not None:
            now = time.time() if now is None else now
            cpu_now = time.process_time() if cpu_now is None else cpu_now
            wall, cpu = self.last_recycle
            if now - wall < self.min_interval_s and cpu_now - cpu < self.work_cpu_s:
                return False
        return quiet()


def exec_again(listener: socket.socket, handover: dict[str, Any] | None) -> None:
    """Replace this process by a new image of the same command line, handing it `listener` and (`handover`) what
    it may start dormant on (`BatchService.handover`). Does not return."""
    fd = listener.detach()
    os.set_inheritable(fd, True)
    os.environ[LISTEN_FD_ENV] = str(fd)
    os.environ[RECYCLED_AT_ENV] = f"{time.time()!r} {time.process_time()!r}"
    if handover is not None:
        os.environ[DORMANT_ENV] = json.dumps(handover)
    else:
        os.environ.pop(DORMANT_ENV, None)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os.execv(sys.executable, list(sys.orig_argv))
