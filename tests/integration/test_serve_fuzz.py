"""Schemathesis fuzz of `run-api`'s OpenAPI schema against a real process: no 5xx, no hang (bounded examples)."""

from __future__ import annotations

import sys

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from factory.serve.client import ApiProcess  # noqa: E402
from tests.conftest import free_port  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    port = free_port()
    command = [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
               "--store_root", str(root), "--max_body_mb", "4", "--log_level", "warning"]
    api = ApiProcess(command, port, log_path=str(root / "api.log")).start()
    try:
        yield schemathesis.openapi.from_url(api.url + "/openapi.json")
    finally:
        api.stop()
        log = (root / "api.log").read_text()
        assert "Traceback" not in log, log[-3000:]


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors_and_no_hangs(case):
    response = case.call(timeout=15)  # a hang fails as a timeout
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
