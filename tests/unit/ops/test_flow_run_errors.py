"""A deployment run that fails on a user error logs one line, not Prefect's tracebacks; bugs keep theirs."""

from __future__ import annotations

import logging

from factory.cli_errors import OneLineUserErrors
from factory.config import ConfigError


def _logged(*errors: BaseException) -> list[logging.LogRecord]:
    logger = logging.getLogger("test.flow_runs.one_line")
    logger.propagate = False
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler, one_line = Keep(), OneLineUserErrors()
    logger.addHandler(handler)
    logger.addFilter(one_line)
    try:
        for error in errors:
            for message in ("Encountered exception during execution: %r",
                            "Engine execution exited with unexpected exception"):
                try:
                    raise error
                except BaseException:
                    logger.exception(message, *((error,) if "%r" in message else ()))
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(one_line)
    return records


def test_a_user_error_is_one_line_once():
    records = _logged(ConfigError("unknown config key 'env.group_sze' (did you mean 'group_size'?)"))
    assert len(records) == 1 and records[0].exc_info is None and records[0].levelno == logging.ERROR
    assert records[0].getMessage() == "flow run failed: unknown config key 'env.group_sze' (did you mean 'group_size'?)"


def test_a_returned_failed_state_is_its_message_and_a_bug_keeps_its_traceback():
    from prefect.exceptions import FailedRun

    failed, bug = _logged(FailedRun("target of 50 groups missed: 12 kept from 100 items")), _logged(KeyError("x"))
    assert [r.getMessage() for r in failed] == ["flow run failed: target of 50 groups missed: 12 kept from 100 items"]
    assert len(bug) == 2 and all(r.exc_info is not None for r in bug)


def test_importing_the_flows_installs_it_on_prefects_flow_run_loggers():
    import flows  # noqa: F401

    for name in ("prefect.flow_runs", "prefect.engine"):
        assert sum(isinstance(f, OneLineUserErrors) for f in logging.getLogger(name).filters) == 1


def test_debug_keeps_prefects_tracebacks(monkeypatch):
    monkeypatch.setenv("FACTORY_DEBUG", "1")
    records = _logged(ConfigError("unknown config key 'x'"))
    assert len(records) == 2 and all(r.exc_info is not None for r in records)
