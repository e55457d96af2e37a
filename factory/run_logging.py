"""The project's own warnings and errors on the flow run's log, where the user looks, not only in the worker's output.

Core code logs with `logging.getLogger(__name__)` and knows nothing of Prefect. While a flow runs,
`project_logs_to_run(run_logger)` hangs a handler on the project's top-level loggers (factory, environments,
tasks, flows, blocks) that passes each record at WARNING or above to the run's logger. The run's logger carries
the flow run id itself, so a record from a thread without Prefect's context (an endpoint health checker, a
scorer pool's reader) still lands on the run.

    with project_logs_to_run(get_run_logger()):
        ...  # logger.warning("endpoint ... unhealthy") in factory/ now shows on the run

Tasks that run in other processes (chunks on a Dask LocalCluster or in SLURM worker jobs) are outside that block:
their task bodies are wrapped with `logs_to_task_run`, which does the same with the task run's logger for the
length of the task, in a process where no flow run forwards project records already (so nothing is sent twice).
Prefect's task run logger reaches the API from the worker process; its records carry the flow run id.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

PROJECT_LOGGERS = ("factory", "environments", "tasks", "flows", "blocks")


class ToRunLogger(logging.Handler):
    """Re-logs records on a (Prefect run) logger adapter, prefixed with the origin logger's name."""

    def __init__(self, run_logger: Any, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.run_logger = run_logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            relog(self.run_logger, record)
        except Exception:  # noqa: BLE001 - logging must never break the run
            self.handleError(record)


def relog(run_logger: Any, record: logging.LogRecord) -> None:
    """`record` on `run_logger`, prefixed with its logger's name (and its traceback from ERROR up)."""
    message = record.getMessage()
    if record.exc_info and record.levelno >= logging.ERROR:
        message += "\n" + logging.Formatter().formatException(record.exc_info)
    run_logger.log(record.levelno, "%s: %s", record.name, message)


@contextmanager
def project_logs_to_run(run_logger: Any, *, level: int = logging.WARNING,
                        names: tuple[str, ...] = PROJECT_LOGGERS) -> Iterator[ToRunLogger]:
    """For the length of a block, project records at `level` or above also go to `run_logger`."""
    handler = ToRunLogger(run_logger, level)
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


class ToTaskRuns(logging.Handler):
    """One per process, while tasks run in it: a record goes to the run logger of the task running in the thread
    that logged it, else (a helper thread: the sampling loop, a health checker) to the newest task's."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.tasks: dict[int, tuple[int, Any]] = {}  # token -> (thread ident, run logger), oldest first

    def emit(self, record: logging.LogRecord) -> None:
        try:
            entries = list(self.tasks.values())
            if not entries:
                return
            run_logger = next((lg for thread, lg in reversed(entries) if thread == record.thread), entries[-1][1])
            relog(run_logger, record)
        except Exception:  # noqa: BLE001 - logging must never break the run
            self.handleError(record)


_task_lock = threading.Lock()
_task_handler: ToTaskRuns | None = None


def forwarded_by_a_flow(names: tuple[str, ...] = PROJECT_LOGGERS) -> bool:
    """Whether a flow run in this process forwards project records already (`project_logs_to_run` is on)."""
    return any(type(h) is ToRunLogger for h in logging.getLogger(names[0]).handlers)


@contextmanager
def project_logs_to_task_run(run_logger: Any, *, level: int = logging.WARNING,
                             names: tuple[str, ...] = PROJECT_LOGGERS) -> Iterator[bool]:
    """For the length of a task: project records at `level` or above also go to `run_logger`, unless a flow run in
    this process forwards them already. Yields whether this task forwards. Tasks running at once in one process
    share one handler (each record is sent once)."""
    global _task_handler
    token = object()
    with _task_lock:
        if forwarded_by_a_flow(names):
            forwarding = False
        else:
            forwarding = True
            if _task_handler is None:
                _task_handler = ToTaskRuns(level)
                for name in names:
                    logging.getLogger(name).addHandler(_task_handler)
            with _task_handler.lock:
                _task_handler.tasks[id(token)] = (threading.get_ident(), run_logger)
    try:
        yield forwarding
    finally:
        if forwarding:
            with _task_lock:
                handler = _task_handler
                assert handler is not None
                with handler.lock:
                    del handler.tasks[id(token)]
                if not handler.tasks:
                    for name in names:
                        logging.getLogger(name).removeHandler(handler)
                    _task_handler = None


def logs_to_task_run(fn: F) -> F:
    """`fn` as a Prefect task's body: inside a task run, the project's warnings it logs reach the run's log wherever
    the task runs (see `project_logs_to_task_run`); called outside Prefect it is `fn`."""

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        from prefect.context import TaskRunContext

        if TaskRunContext.get() is None:
            return fn(*args, **kwargs)
        from prefect import get_run_logger

        with project_logs_to_task_run(get_run_logger()):
            return fn(*args, **kwargs)

    return body  # type: ignore[return-value]


def outcome_warning(summary: dict[str, Any]) -> str | None:
    """A warning for the run's log when a datagen run kept nothing, naming the drop reasons; else None."""
    if summary.get("groups_kept", 0) or summary.get("stop_message") and "stopped by" in str(summary["stop_message"]):
        return None
    dropped = {reason: count for reason, count in (summary.get("dropped") or {}).items() if count}
    if not dropped and not summary.get("chunks_committed"):
        return None  # nothing was done this run (e.g. everything was committed before)
    reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(dropped.items(), key=lambda kv: -kv[1]))
    hint = ""
    if dropped.get("equal_scores"):
        hint = ("; every answer of a group scored the same (the policy is always right or always wrong here): "
                "try a stronger policy, other difficulties, or env.ensure_scores_are_not_same false")
    elif dropped.get("failed"):
        hint = "; groups failed (see the errors above: endpoint, judge or scorer)"
    elif dropped.get("too_long"):
        hint = "; groups were too long: raise env.max_token_length or lower env.max_tokens"
    return f"0 groups kept in run {summary.get('run_id')!r}: all dropped ({reasons or 'no reason recorded'}){hint}"
