"""Set the Prefect state of the runs a job owns: failed without retry, cancelled on SIGTERM, crashed when dead.

Everything here is best effort with short timeouts: it runs while a process is
stopping, and a Prefect API that does not answer must not keep it alive.

A datagen run leaves an owner file (`.owner-<producer>.json`: host, pid, flow run
ids) in its run directory while it works. The next start of the same run and
producer marks the runs of an owner whose process is gone as Crashed (a `kill -9`
leaves them RUNNING forever otherwise), and refuses to start while the owner is
still alive on this host.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def current_flow_run_id() -> str | None:
    """The id of the flow run this code runs in, or None outside a flow."""
    try:
        from prefect.context import FlowRunContext
    except ImportError:  # pragma: no cover
        return None
    context = FlowRunContext.get()
    return str(context.flow_run.id) if context and context.flow_run else None


def set_state(flow_run_ids: list[str], state_type: str, message: str, *, force: bool = True,
              only_if_running: bool = False) -> list[str]:
    """Set `state_type` (Failed, Cancelled, Crashed) on each run; returns the ids changed. Never raises."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Crashed, Failed

    make = {"Failed": Failed, "Cancelled": Cancelled, "Crashed": Crashed}[state_type]
    changed = []
    try:
        with get_client(sync_client=True) as client:
            for run_id in flow_run_ids:
                try:
                    if only_if_running:
                        run = client.read_flow_run(run_id)
                        if run.state is None or run.state.type.value not in ("RUNNING", "PENDING", "CANCELLING"):
                            continue
                    client.set_flow_run_state(run_id, make(message=message), force=force)
                    changed.append(run_id)
                except Exception as error:  # noqa: BLE001 - best effort per run
                    logger.warning("could not mark flow run %s %s: %s", run_id, state_type, error)
    except Exception as error:  # noqa: BLE001 - no API at all
        logger.warning("could not reach the Prefect API to mark runs %s: %s", state_type, error)
    return changed


def fail_without_retry(message: str) -> None:
    """Mark the current flow run Failed now, bypassing its retries (for errors a retry cannot fix)."""
    run_id = current_flow_run_id()
    if run_id:
        set_state([run_id], "Failed", message)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunOwner:
    """The owner file of (run dir, producer): who is working on it, so a dead owner's runs can be crashed."""

    def __init__(self, run_dir: str | Path, producer: str) -> None:
        self.path = Path(run_dir) / f".owner-{producer}.json"
        self.sole_writer = False
        """Set by `claim`: no other writer of this producer can be left alive."""

    def read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def claim(self, flow_run_ids: list[str]) -> list[str]:
        """Take ownership; crash the runs of a dead previous owner (returned). Raises if the owner is alive here.

        Afterwards `sole_writer` says whether no other writer of this producer can be left alive (no previous owner,
        or a dead one on this host), so what a stopped process left may be cleaned up (`run_outcome.clean_start`);
        an owner on another host may still be writing."""
        crashed: list[str] = []
        previous = self.read()
        if previous and previous.get("pid") != os.getpid():
            same_host = previous.get("host") == socket.gethostname()
            if same_host and _alive(int(previous["pid"])):
                from factory.preflight import PreflightError

                raise PreflightError("datagen.run_id", self.path.parent.name, f"already being written by pid "
                                     f"{previous['pid']} on this host (flow runs {previous.get('flow_runs')}); "
                                     "stop it or use another run id / producer")
            stale = [r for r in previous.get("flow_runs", []) if r not in flow_run_ids]
            if stale:
                crashed = set_state(stale, "Crashed", f"its process (pid {previous.get('pid')} on "
                                    f"{previous.get('host')}) died; found by the next run of {self.path.parent.name}",
                                    only_if_running=True)
                if crashed:
                    logger.warning("marked %d run(s) of a dead previous process Crashed: %s", len(crashed), crashed)
        self.sole_writer = not previous or previous.get("host") == socket.gethostname()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "flow_runs": flow_run_ids}))
        os.replace(tmp, self.path)
        return crashed

    def release(self) -> None:
        current = self.read()
        if current and current.get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
