"""A run that fails because the Prefect API is down says so in one line, with the API's URL."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import httpx
import pytest

from factory.prefect_outage import describe_prefect_outage
from tests.conftest import free_port


def failed_request(url: str) -> httpx.TransportError:
    try:
        httpx.get(url, timeout=2)
    except httpx.TransportError as error:
        return error
    pytest.fail(f"{url} answered")


def test_a_refused_prefect_request_becomes_one_line_naming_the_url():
    api = f"http://127.0.0.1:{free_port()}/api"
    cause = failed_request(f"{api}/flow_runs/filter")
    try:
        try:
            raise cause
        except httpx.TransportError as error:
            raise RuntimeError("flow run failed") from error
    except RuntimeError as wrapped:
        line = describe_prefect_outage(wrapped, api_url=api)
    assert line is not None and "\n" not in line
    assert line.startswith(f"the Prefect API at {api} stopped answering (ConnectError")
    assert "rerun with the same run id" in line


def test_other_failures_are_left_as_they_are():
    api = f"http://127.0.0.1:{free_port()}/api"
    inference = failed_request(f"http://127.0.0.1:{free_port()}/v1/completions")
    assert describe_prefect_outage(inference, api_url=api) is None
    assert describe_prefect_outage(ValueError("bad config"), api_url=api) is None


def test_client_retries_cover_the_configured_outage_window(monkeypatch):
    from factory.prefect_outage import client_max_retries, outage_environ, ridden_out_s

    assert client_max_retries(60) == 5 and ridden_out_s(5) == 62  # Prefect's default: about a minute
    assert client_max_retries(300) == 8 and ridden_out_s(8) == 510  # >= 5 minutes
    assert client_max_retries(14) == 3
    monkeypatch.delenv("PREFECT_CLIENT_MAX_RETRIES", raising=False)
    monkeypatch.setenv("FACTORY_PREFECT_OUTAGE_S", "120")
    assert outage_environ() == {"PREFECT_CLIENT_MAX_RETRIES": "6"}
    monkeypatch.setenv("PREFECT_CLIENT_MAX_RETRIES", "2")  # an explicit setting wins
    assert outage_environ() == {"PREFECT_CLIENT_MAX_RETRIES": "2"}


def test_the_local_stack_exports_the_retry_setting(monkeypatch, tmp_path):
    from factory.local_prefect import LocalPrefect

    monkeypatch.delenv("PREFECT_CLIENT_MAX_RETRIES", raising=False)
    monkeypatch.delenv("FACTORY_PREFECT_OUTAGE_S", raising=False)
    assert LocalPrefect(home=tmp_path).environ()["PREFECT_CLIENT_MAX_RETRIES"] == "8"


def test_a_report_during_an_outage_is_a_warning_not_a_failed_run(caplog):
    from factory.prefect_outage import best_effort

    api = f"http://127.0.0.1:{free_port()}/api"

    def update_artifact():
        httpx.get(f"{api}/artifacts/x", timeout=2)

    assert best_effort(update_artifact, what="test artifact") is None
    assert best_effort(update_artifact, what="test artifact") is None
    assert sum("skipped test artifact" in r.getMessage() for r in caplog.records) == 1
    assert best_effort(lambda: 7) == 7
    with pytest.raises(ZeroDivisionError):
        best_effort(lambda: 1 / 0)  # a bug is not swallowed


def test_the_outage_line_stays_last_and_whole_when_other_threads_write_to_stderr():
    # Prefect's log worker reports a failed upload as "--- Error logging to API ---\n" + the error, with no newline,
    # and keeps running while the process leaves: CI once saw "All connection attempts failederror: the Prefect ...".
    script = textwrap.dedent("""
        import sys, threading, time
        from factory.prefect_outage import exit_with_outage

        sys.stderr.write("--- Error logging to API ---\\nAll connection attempts failed")
        def chatter():
            while True:
                sys.stderr.write("late report without newline")
                time.sleep(0.001)
        threading.Thread(target=chatter, daemon=True).start()
        time.sleep(0.05)
        exit_with_outage("the Prefect API at http://127.0.0.1:9/api stopped answering")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1] == "error: the Prefect API at http://127.0.0.1:9/api stopped answering", done.stderr[-500:]


def test_the_api_watch_fails_a_run_once_the_api_is_gone_for_its_window_naming_the_api():
    import socket

    from factory import prefect_outage
    from factory.prefect_outage import ApiWatch, PrefectApiGone, best_effort, describe_prefect_outage

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        api = f"http://127.0.0.1:{s.getsockname()[1]}/api"
    now = [100.0]
    watch = ApiWatch(api, window_s=14, every_s=5, clock=lambda: now[0])
    try:
        watch.check()  # first failure: down, within the window
        assert watch.down_since == 100.0
        reports = []
        assert best_effort(reports.append, "progress") is None and reports == []  # skipped while down, no retries
        now[0] += 3
        watch.check()  # not probed again within every_s
        now[0] += 11.5
        with pytest.raises(PrefectApiGone) as raised:
            watch.check()
        line = describe_prefect_outage(raised.value, api)
        assert line and line.startswith(f"the Prefect API at {api} stopped answering")
    finally:
        prefect_outage._api_down = False


def test_the_api_watch_forgets_an_outage_shorter_than_its_window():
    from factory import prefect_outage
    from factory.prefect_outage import ApiWatch

    answers = iter([OSError("refused"), OSError("refused"), None, OSError("refused")])

    def probe(url):
        if (answer := next(answers)) is not None:
            raise answer

    now = [0.0]
    watch = ApiWatch("http://prefect/api", window_s=14, every_s=5, clock=lambda: now[0], probe=probe)
    try:
        for step in range(4):
            watch.check()
            now[0] += 6
        assert watch.down_since == 18.0 and prefect_outage._api_down  # the last failure starts a new window
        reports = []
        prefect_outage._api_down = False
        prefect_outage.best_effort(reports.append, "progress")
        assert reports == ["progress"]
    finally:
        prefect_outage._api_down = False
