"""The project's own warnings and errors on the flow run's log, where the user looks, not only in the worker's output.

Core code logs with `logging.getLogger(__name__)` and knows nothing of Prefect. While a flow runs,
`project_logs_to_run(run_logger)` hangs a handler on the project's top-level loggers (factory, environments,
tasks, flows, blocks) that passes each record at WARNING or above to the run's logger. The run's logger carries
the flow run id itself, so a record from a thread without Prefect's context (an endpoint health checker, a
scorer pool's reader) still lands on the run.

    with project_logs_to_run(get_run_logger()):
        ...  # logger.warning("endpoint ... unhealthy") in factory/ now shows on the run
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PROJECT_LOGGERS = ("factory", "environments", "tasks", "flows", "blocks")


class ToRunLogger(logging.Handler):
    """Re-logs records on a (Prefect run) logger adapter, prefixed with the origin logger's name."""

    def __init__(self, run_logger: Any, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.run_logger = run_logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info and record.levelno >= logging.ERROR:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            self.run_logger.log(record.levelno, "%s: %s", record.name, message)
        except Exception:  # noqa: BLE001 - logging must never break the run
            self.handleError(record)


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
