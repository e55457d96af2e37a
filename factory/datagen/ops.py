"""The datagen flow's operability glue: run ownership, graceful stop, progress line and artifacts on the user's run.

`RunOps.start` is called first thing in the pipeline flow. It claims the run's
owner file (crashing the Prefect runs of a dead previous owner), cleans up what
a stopped process of the producer left (`run_outcome.clean_start`: shards whose
commit record is durable are renamed into place first, then temp files and
stats of uncommitted chunks go), installs the
SIGTERM/SIGINT handler (stop taking chunks, give chunks in flight
`datagen.shutdown_grace_s` to finish and commit, mark the runs Cancelled, exit),
and finds the run the user started (the deployment's parent run, else this one)
so the progress and summary artifacts land where the user looks.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

from factory.prefect_outage import ApiWatch, prefect_api_url
from factory.progress import PROGRESS_PREFIX, ChunkProgress
from factory.slurm_cluster import ClusterFault
from factory.run_control import RunOwner, current_flow_run_id, set_state
from factory.run_outcome import clean_start
from factory.shutdown import GracefulStop, hard_exit


class RunStopped(Exception):
    """The run stopped on a signal; `code` is the process exit status to use (128 + signal)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def parent_flow_run_id() -> str | None:
    """The flow run that called this subflow (the deployment's run), or None at top level."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    task_run_id = context.flow_run.parent_task_run_id if context and context.flow_run else None
    if task_run_id is None:
        return None
    try:
        with get_client(sync_client=True) as client:
            flow_run_id = client.read_task_run(task_run_id).flow_run_id
    except Exception:  # noqa: BLE001 - artifacts then stay on this run
        return None
    return str(flow_run_id) if flow_run_id else None


def _current_task_runner() -> Any:
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return context.task_runner if context else None


_current: RunOps | None = None


def close_current(*_: Any) -> None:
    """Flow state hook: restore signal handlers if the pipeline failed or crashed."""
    if _current is not None:
        _current.close()


class RunOps:
    def __init__(self, store: Any, cfg: Any, logger: Any) -> None:
        d = cfg.datagen
        self.logger = logger
        self.own_run = current_flow_run_id()
        self.parent_run = parent_flow_run_id() if self.own_run else None
        self.report_run = self.parent_run or self.own_run
        self.runs = [r for r in (self.own_run, self.parent_run) if r]
        self.owner = RunOwner(store.run_dir(d.run_id), d.producer)
        self.stop = GracefulStop(d.shutdown_grace_s, on_abandon=self._abandon)
        self.progress: ChunkProgress | None = None
        self.target_groups: int | None = d.target_groups
        self._progress_artifact: Any = None
        self.runner = _current_task_runner()
        api_url = prefect_api_url() if self.own_run else None
        self.api_watch = ApiWatch(api_url) if api_url else None
        """Fails the run once the Prefect API has been gone for the client's retry window (checked between chunks)."""

    def check_prefect_api(self) -> None:
        if self.api_watch is not None:
            self.api_watch.check()

    @classmethod
    def start(cls, store: Any, cfg: Any, logger: Any) -> RunOps:
        global _current
        if _current is not None:
            _current.close()
        ops = _current = cls(store, cfg, logger)
        ops.owner.claim(ops.runs)
        if ops.owner.sole_writer:  # no writer of this producer can be left alive: what a stopped one left can go
            d = cfg.datagen
            clean_start(store, d.run_id, d.producer)
        ops.stop.__enter__()
        return ops

    def close(self) -> None:
        global _current
        self.stop.__exit__(None, None, None)
        if _current is self:
            _current = None

    # ---- stop ---------------------------------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self.stop.requested

    def finishes_in_grace(self, future: Any) -> bool:
        """Wait for a chunk in flight until the grace period ends; whether it finished."""
        future.wait(timeout=self.stop.remaining())
        state = future.state
        return state is not None and state.is_final()

    def _message(self, abandoned: int) -> str:
        committed = self.progress.session_chunks if self.progress else 0
        return (f"stopped by {self.stop.signal_name}: {committed} chunk(s) committed this session, {abandoned} in "
                "flight abandoned uncommitted; rerun with the same run id to resume")

    def _abandon(self, reason: str) -> None:
        message = f"stopped by {self.stop.signal_name}: {reason}; chunks in flight abandoned uncommitted, rerun to resume"
        set_state(self.runs, "Cancelled", message)
        print(f"error: {message}", file=sys.stderr, flush=True)

    def stopped(self, summary: dict[str, Any], abandoned: list[int]) -> Any:
        """After a signal: mark the runs Cancelled; exit at once if chunks were abandoned (their threads are busy)."""
        from prefect.states import Cancelled

        message = self._message(len(abandoned))
        self.logger.warning(message)
        set_state(self.runs, "Cancelled", message)
        self.owner.release()
        code = 128 + (self.stop.signum or signal.SIGTERM)
        if abandoned:
            print(f"error: {message}", file=sys.stderr, flush=True)
            hard_exit(code)
        self.close()
        return Cancelled(message=message)

    def finished(self) -> None:
        self.owner.release()
        self.close()

    # ---- futures -----------------------------------------------------------------------------------------------

    def result(self, grouped: Any) -> Any:
        """The chunk's result (raises the rollout task's own error when it failed).

        On a task runner that can tell a fault (SlurmTaskRunner: a worker job died on start-up), waiting is in
        one-second steps, and a fault fails the runs at once, without retries: no worker would ever come.
        """
        if not hasattr(self.runner, "fault"):
            return grouped.result()
        while True:
            try:
                return grouped.result(timeout=1.0)
            except TimeoutError:
                if fault := self.runner.fault():
                    set_state(self.runs, "Failed", fault)
                    raise ClusterFault(fault) from None

    # ---- progress ----------------------------------------------------------------------------------------------

    def track(self, name: str, *, total_chunks: int, done_before: int, groups_before: int = 0) -> None:
        self.progress = ChunkProgress(name, total_chunks=total_chunks, done_before=done_before,
                                      groups_before=groups_before, target_groups=self.target_groups)
        self.logger.info(PROGRESS_PREFIX + self.progress.line())
        self._mark_target_reached()

    def chunk_committed(self, *, groups_kept: int, rollouts: int, detail: str = "") -> None:
        """Count a committed chunk and log the progress line, with `detail` (what the chunk kept and dropped) on
        the same line: one log record per chunk (each record costs the flow ~0.5 ms: console, API shipping)."""
        if self.progress is not None:
            line = PROGRESS_PREFIX + self.progress.update(groups_kept=groups_kept, rollouts=rollouts)
            self.logger.info(f"{line} ({detail})" if detail else line)
            self._mark_target_reached()

    def _mark_target_reached(self) -> None:
        """Once the target is reached, the progress artifact says so (100%), whatever chunks were left unplanned."""
        if self._progress_artifact is None or self.progress is None or not self.progress.target_reached:
            return
        from prefect.artifacts import update_progress_artifact

        from factory.prefect_outage import best_effort

        best_effort(update_progress_artifact, self._progress_artifact, 100.0,
                    description=f"{self.progress.name}: target of {self.target_groups} groups reached")

    def _create_artifact(self, **fields: Any) -> Any:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactCreate

        with get_client(sync_client=True) as client:
            return client.create_artifact(ArtifactCreate(flow_run_id=self.report_run, **fields))

    def progress_artifact(self, progress: float, *, key: str, description: str) -> Any:
        """A progress artifact on the run the user started; returns its id (for update_progress_artifact)."""
        if self.report_run is None:
            from prefect.artifacts import create_progress_artifact

            self._progress_artifact = create_progress_artifact(progress=progress, key=key, description=description)
        else:
            self._progress_artifact = self._create_artifact(type="progress", key=key, data=progress,
                                                            description=description).id
        self._mark_target_reached()
        return self._progress_artifact

    def summary_artifact(self, rows: list[dict[str, Any]], *, key: str, description: str, store_dir: str) -> None:
        """The summary table on the run the user started, its description linking to the store."""
        link = store_dir if "://" in store_dir else Path(store_dir).absolute().as_uri()  # s3://... as it is
        description = f"{description}; shards under [{store_dir}]({link})"
        if self.report_run is None:
            from prefect.artifacts import create_table_artifact

            create_table_artifact(table=rows, key=key, description=description)
            return
        self._create_artifact(type="table", key=key, data=rows, description=description)
