"""A run that fails because the Prefect API is down says so in one line, with the API's URL."""

from __future__ import annotations

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
