"""The project's warnings reach the run's logger while a flow runs; a run that kept nothing says so."""

from __future__ import annotations

import inspect
import logging
import threading

from factory.run_logging import (ToRunLogger, ToTaskRuns, logs_to_task_run, outcome_warning, project_logs_to_run,
                                 project_logs_to_task_run)


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


def in_thread(fn) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def test_tasks_in_a_worker_process_forward_to_their_own_run_logger_each_record_once():
    """Two tasks at once in a process without a flow run (a Dask worker): a record goes to the task of the thread
    that logged it; one from a helper thread (the sampling loop) to the newest task; nothing after both end."""
    first, second = Recorder(), Recorder()
    in_first, second_started, second_done = threading.Event(), threading.Event(), threading.Event()
    forwarding = []

    def task_two() -> None:
        in_first.wait()
        with project_logs_to_task_run(second) as on:
            forwarding.append(on)
            second_started.set()
            logging.getLogger("tasks.score").warning("from task two")
            second_done.wait()

    two = threading.Thread(target=task_two)
    two.start()
    with project_logs_to_task_run(first) as on:
        forwarding.append(on)
        in_first.set()
        second_started.wait()
        logging.getLogger("factory.inference.endpoints").warning("from task one")
        in_thread(lambda: logging.getLogger("factory.inference.health").error("from a helper thread"))
        second_done.set()
        two.join()
        logging.getLogger("environments.llm_judge").info("below WARNING")
    logging.getLogger("factory").warning("after both tasks")
    assert forwarding == [True, True]
    assert first.records == [(logging.WARNING, "factory.inference.endpoints: from task one")]
    assert second.records == [(logging.WARNING, "tasks.score: from task two"),
                              (logging.ERROR, "factory.inference.health: from a helper thread")]
    assert not [h for h in logging.getLogger("factory").handlers if isinstance(h, (ToRunLogger, ToTaskRuns))]


def test_a_task_in_the_flow_process_leaves_forwarding_to_the_flow_run():
    """The thread runner: the flow forwards project records already; the task adds nothing (no record twice)."""
    flow_logger, task_logger = Recorder(), Recorder()
    with project_logs_to_run(flow_logger), project_logs_to_task_run(task_logger) as forwarding:
        logging.getLogger("tasks.generate").warning("item 3 failed")
    assert forwarding is False
    assert flow_logger.records == [(logging.WARNING, "tasks.generate: item 3 failed")] and task_logger.records == []


def test_a_task_body_outside_prefect_is_the_plain_function_with_its_signature():
    def chunk(spec: str, indices: list[int], *, tokenizer_name: str | None = None) -> tuple:
        logging.getLogger("factory").warning("not forwarded: no task run")
        return spec, indices, tokenizer_name

    body = logs_to_task_run(chunk)
    assert inspect.signature(body) == inspect.signature(chunk) and body.__name__ == "chunk"
    assert body("s", [1], tokenizer_name="t") == ("s", [1], "t")
    assert not [h for h in logging.getLogger("factory").handlers if isinstance(h, (ToRunLogger, ToTaskRuns))]


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
