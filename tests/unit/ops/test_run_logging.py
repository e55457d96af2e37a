"""The project's warnings reach the run's logger while a flow runs; a run that kept nothing says so."""

from __future__ import annotations

import logging
import threading

from factory.run_logging import outcome_warning, project_logs_to_run


class Recorder:
    def __init__(self) -> None:
        self.records: list[tuple[int, str]] = []

    def log(self, level: int, message: str, *args: object) -> None:
        self.records.append((level, message % args))


def test_project_warnings_from_any_thread_go_to_the_run_logger_and_stop_after_the_block():
    run_logger = Recorder()
    with project_logs_to_run(run_logger):
        logging.getLogger("factory.inference.endpoints").warning("endpoint %s unhealthy", "http://x")
        logging.getLogger("environments.llm_judge").info("not forwarded: below WARNING")
        logging.getLogger("some.other.library").warning("not ours")
        thread = threading.Thread(target=lambda: logging.getLogger("tasks.score").error("scorer died"))
        thread.start()
        thread.join()
    logging.getLogger("factory").warning("after the block")
    assert run_logger.records == [(logging.WARNING, "factory.inference.endpoints: endpoint http://x unhealthy"),
                                  (logging.ERROR, "tasks.score: scorer died")]
    assert not any(type(h).__name__ == "ToRunLogger" for h in logging.getLogger("factory").handlers)


def summary(kept: int, **dropped: int) -> dict:
    reasons = {"failed": 0, "wrong_size": 0, "too_long": 0, "equal_scores": 0, **dropped}
    return {"run_id": "r", "groups_kept": kept, "dropped": reasons, "chunks_committed": 1}


def test_zero_groups_kept_is_a_warning_naming_the_drop_reasons():
    message = outcome_warning(summary(0, equal_scores=6, failed=2))
    assert message.startswith("0 groups kept in run 'r': all dropped (6 equal_scores, 2 failed)")
    assert "ensure_scores_are_not_same" in message
    assert "judge" in outcome_warning(summary(0, failed=4))


def test_no_warning_when_groups_were_kept_or_nothing_was_done():
    assert outcome_warning(summary(3, equal_scores=5)) is None
    assert outcome_warning({"run_id": "r", "groups_kept": 0, "dropped": {}, "chunks_committed": 0}) is None
