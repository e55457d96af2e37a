"""Bring the embedded Prefect stack up and down: a local server on SQLite, a process work pool and a worker.

Prefect's ephemeral mode serves one process only (each Dask worker process
would start its own temporary server on the same SQLite file), so the laptop
default is a real `prefect server` under a project directory. Everything lives
in `FACTORY_HOME` (default `./.factory`): the Prefect home and database, pid
files and logs.

`up` creates every work pool that prefect.yaml's deployments name (a process pool each), so `prefect deploy
--all` registers them all; it starts a worker for `local-process` only. A SLURM deployment's pool
(`slurm-head`) waits for a worker started where sbatch works (README "Running on a cluster").

One checkout, one stack: a port that already serves another checkout's stack
is refused (naming that checkout and a free port to use instead), never reused;
the port chosen with FACTORY_PREFECT_PORT is remembered in `stack.json`, so
`factory-local env`, `status` and `down` find the same stack later.

    factory-local up       # server + work pools + worker, waits until healthy
    factory-local env      # prints the exports that point a shell at it
    factory-local status
    factory-local down     # SIGINT to the worker, SIGTERM to the server
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from factory.prefect_outage import outage_environ

DEFAULT_PORT = 4200
DEFAULT_POOL = "local-process"
STACK_FILE = "stack.json"
"""In FACTORY_HOME: the port this checkout's stack uses, written by `up`."""
ZOMBIE_AUTOMATION = "crash-zombie-flow-runs"
HEARTBEAT_S = 30
"""Flow runs started against this stack send a heartbeat every HEARTBEAT_S seconds (Prefect's minimum); a RUNNING
run that misses them for ZOMBIE_AFTER_S is marked Crashed by the ZOMBIE_AUTOMATION that `up` installs."""
ZOMBIE_AFTER_S = 90


class StackError(RuntimeError):
    """The local stack cannot start here; the message names the cause and the fix."""


@dataclass(frozen=True)
class LocalPrefect:
    """Where the local stack lives and how to reach it."""

    home: Path
    port: int = DEFAULT_PORT
    pool: str = DEFAULT_POOL
    created_pools: list[str] = dataclasses.field(default_factory=list, compare=False)

    @classmethod
    def from_env(cls) -> LocalPrefect:
        """FACTORY_HOME (default ./.factory); port from FACTORY_PREFECT_PORT, else the one `up` remembered, else 4200."""
        home = Path(os.environ.get("FACTORY_HOME", ".factory")).absolute()
        port = os.environ.get("FACTORY_PREFECT_PORT")
        if not port:
            try:
                port = json.loads((home / STACK_FILE).read_text())["port"]
            except (OSError, ValueError, KeyError, TypeError):
                port = DEFAULT_PORT
        return cls(home=home, port=int(port))

    @property
    def prefect_home(self) -> Path:
        return self.home / "prefect"

    def server_home(self, timeout: float = 5.0) -> str | None:
        """PREFECT_HOME of the Prefect server answering on this port (which checkout's stack it is), if it says."""
        try:
            with urllib.request.urlopen(f"{self.api_url}/admin/settings", timeout=timeout) as response:
                return str(json.loads(response.read()).get("home") or "") or None
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return None

    def _refuse_foreign_server(self) -> None:
        """Raise StackError when the port answers as a Prefect server of another checkout (or anything else)."""
        if not self.healthy():
            raise StackError(f"port {self.port} is taken by something that is not a Prefect server; "
                             f"run `FACTORY_PREFECT_PORT={_free_port()} factory-local up` to use a free port")
        other = self.server_home()
        if other is not None and Path(other).absolute() == self.prefect_home:
            return  # this checkout's own server, started before its pid file went missing
        owner = str(Path(other).parent.parent) if other else "an unknown folder"
        raise StackError(f"port {self.port} already serves the Prefect stack of another checkout ({owner}); this "
                         f"checkout ({self.home.parent}) gets its own: `FACTORY_PREFECT_PORT={_free_port()} "
                         "factory-local up` (the port is remembered), or stop the other with `factory-local down` there")

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def environ(self) -> dict[str, str]:
        """Variables that point Prefect clients and servers at this stack."""
        prefect_home = self.prefect_home
        return {
            "PREFECT_HOME": str(prefect_home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{prefect_home / 'prefect.db'}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(self.port),
            "PREFECT_UI_API_URL": self.api_url,
            "PREFECT_LOGGING_LEVEL": os.environ.get("PREFECT_LOGGING_LEVEL", "INFO"),
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S)),
            **outage_environ(),  # clients retry long enough to ride out a server restart (FACTORY_PREFECT_OUTAGE_S)
        }

    def _pidfile(self, name: str) -> Path:
        return self.home / f"{name}.pid"

    def _log(self, name: str) -> Path:
        return self.home / f"{name}.log"

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api_url}/health", timeout=timeout) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _start(self, name: str, argv: list[str]) -> int:
        self.home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.environ()}
        with open(self._log(name), "ab") as log:
            process = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self._pidfile(name).write_text(str(process.pid))
        return process.pid

    def _pid(self, name: str) -> int | None:
        try:
            pid = int(self._pidfile(name).read_text())
        except (FileNotFoundError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return pid

    def up(self, *, worker: bool = True, timeout: float = 120.0) -> None:
        """Start what is not running yet and wait for the API to answer."""
        if self._pid("server") is None:
            if _port_busy(self.port):
                self._refuse_foreign_server()
            else:
                self._start("server", [sys.executable, "-m", "factory.prefect_server"])  # see factory/prefect_server.py
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self._pid("server") is None:
                raise StackError(f"the Prefect server exited during start-up; see {self._log('server')}")
            if time.monotonic() > deadline:
                raise StackError(f"the Prefect server did not answer within {timeout:.0f}s; see {self._log('server')}")
            time.sleep(0.5)
        (self.home / STACK_FILE).write_text(json.dumps({"port": self.port, "api_url": self.api_url,
                                                        "checkout": str(self.home.parent)}) + "\n")
        self.ensure_pools()
        self.ensure_zombie_automation()
        if worker and self._pid("worker") is None:
            self._start("worker", [sys.executable, "-m", "prefect", "worker", "start", "--pool", self.pool, "--type", "process"])

    def pools(self) -> list[str]:
        """The work pools to create: this stack's own, then every other one the checkout's prefect.yaml names."""
        return list(dict.fromkeys([self.pool, *deployment_pools(self.home.parent / "prefect.yaml")]))

    def ensure_pools(self) -> list[str]:
        """Create every work pool in `pools()` that does not exist yet; returns (and remembers) the ones created."""
        self.created_pools[:] = [name for name in self.pools() if self._ensure_pool(name)]
        return list(self.created_pools)

    def _ensure_pool(self, name: str) -> bool:
        """Create process work pool `name` unless it exists; whether it was created."""
        env = {**os.environ, **self.environ()}
        listing = subprocess.run(
            [sys.executable, "-m", "prefect", "work-pool", "inspect", name], env=env, capture_output=True, text=True
        )
        if listing.returncode == 0:
            return False
        created = subprocess.run(
            [sys.executable, "-m", "prefect", "work-pool", "create", name, "--type", "process"],
            env=env,
            capture_output=True,
            text=True,
        )
        if created.returncode != 0 and "already exists" not in created.stdout + created.stderr:
            raise StackError(f"could not create work pool {name!r}: {created.stdout}{created.stderr}")
        return True

    def ensure_zombie_automation(self) -> None:
        """Install Prefect's zombie detection: a RUNNING flow run whose heartbeats stop is marked Crashed."""
        from datetime import timedelta

        from prefect.automations import Automation
        from prefect.client.schemas.objects import StateType
        from prefect.events.actions import ChangeFlowRunState
        from prefect.events.schemas.automations import EventTrigger, Posture
        from prefect.events.schemas.events import ResourceSpecification
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.api_url}):
            try:
                Automation.read(name=ZOMBIE_AUTOMATION)
                return
            except ValueError:
                pass
            Automation(
                name=ZOMBIE_AUTOMATION,
                description=f"Mark a flow run Crashed when it sends no heartbeat for {ZOMBIE_AFTER_S}s (its process died).",
                trigger=EventTrigger(
                    after={"prefect.flow-run.heartbeat"},
                    expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                            "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
                    match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                    for_each={"prefect.resource.id"},
                    posture=Posture.Proactive,
                    threshold=1,
                    within=timedelta(seconds=ZOMBIE_AFTER_S),
                ),
                actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                            message=f"no heartbeat for {ZOMBIE_AFTER_S}s: the flow run's process died")],
            ).create()

    def down(self, timeout: float = 30.0) -> None:
        """Stop the worker (SIGINT, its clean stop) and then the server."""
        for name, sig in (("worker", signal.SIGINT), ("server", signal.SIGTERM)):
            pid = self._pid(name)
            if pid is None:
                self._pidfile(name).unlink(missing_ok=True)
                continue
            _signal_group(pid, sig)
            if not _wait_gone(pid, timeout):
                _signal_group(pid, signal.SIGKILL)
                _wait_gone(pid, 5)
            self._pidfile(name).unlink(missing_ok=True)

    def status(self) -> dict[str, object]:
        return {
            "api_url": self.api_url,
            "healthy": self.healthy(),
            "server_pid": self._pid("server"),
            "worker_pid": self._pid("worker"),
            "home": str(self.home),
        }


def deployment_pools(prefect_yaml: Path) -> list[str]:
    """Work pool names that the deployments of a prefect.yaml use, in order of first use ([] without the file)."""
    import yaml

    try:
        spec = yaml.safe_load(prefect_yaml.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return []
    names = [((d or {}).get("work_pool") or {}).get("name") for d in spec.get("deployments") or []]
    return list(dict.fromkeys(name for name in names if isinstance(name, str) and name))


@contextlib.contextmanager
def temporary_local_prefect(home: Path, port: int) -> Iterator[dict[str, str]]:
    """A local Prefect server for the length of a block, its settings exported into this process's environment.

    On exit Prefect's queued logs and events are shipped while the server is still
    up (drain_prefect_workers), then the server stops and the environment is restored.
    """
    stack = LocalPrefect(home=home, port=port)
    stack.up(worker=False)
    saved = {key: os.environ.get(key) for key in stack.environ()}
    os.environ.update(stack.environ())
    try:
        yield stack.environ()
    finally:
        drain_prefect_workers()
        stack.down()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def drain_prefect_workers(timeout: float = 10) -> None:
    """Ship Prefect's queued logs and events while its server is still up; call it just before stopping the server.

    Otherwise the process outlives its work by a minute or two, its APILogWorker /
    EventsWorker retrying against a server that is gone.
    """
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_busy(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            waited, _ = os.waitpid(pid, os.WNOHANG)
            if waited == pid:
                return True
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def main(argv: list[str] | None = None) -> int:
    """`factory-local {up,down,status,env}`; user errors end in one line (factory/cli_errors.py)."""
    from factory.cli_errors import run_cli

    return run_cli("factory-local", _main, argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="factory-local", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "down", "status", "env"])
    parser.add_argument("--no-worker", action="store_true", help="start the server and pool only")
    args = parser.parse_args(argv)
    stack = LocalPrefect.from_env()
    if args.command == "up":
        stack.up(worker=not args.no_worker)
        print(f"Prefect is up at {stack.api_url} (UI: http://127.0.0.1:{stack.port}); work pool '{stack.pool}' "
              "with a worker.")
        for name in stack.pools()[1:]:
            print(f"Work pool '{name}' {'created' if name in stack.created_pools else 'exists'}, no worker here: start "
                  f"one where its jobs can run (`prefect worker start --pool {name}`; README \"Running on a cluster\").")
        print("Point a shell at it with: eval \"$(factory-local env)\"")
    elif args.command == "down":
        stack.down()
        print("Prefect stack stopped.")
    elif args.command == "env":
        for key, value in stack.environ().items():
            print(f"export {key}={value!r}")
    else:
        for key, value in stack.status().items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
