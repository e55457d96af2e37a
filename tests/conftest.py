"""Shared fixtures: offline Hugging Face, a real local Prefect server for tests that need one."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real `prefect server` on SQLite in a temp dir, with a process work pool (no worker).

    Yields the environment variables that point clients at it and exports them
    into this process for the session, so `@flow` calls in tests report to it.
    """
    from factory.local_prefect import LocalPrefect

    stack = LocalPrefect(home=tmp_path_factory.mktemp("prefect-home"), port=free_port())
    stack.up(worker=False)
    saved = {key: os.environ.get(key) for key in stack.environ()}
    os.environ.update(stack.environ())
    from prefect.settings import PREFECT_API_URL, temporary_settings

    try:
        with temporary_settings(updates={PREFECT_API_URL: stack.api_url}):
            yield stack.environ()
    finally:
        _drain_prefect_workers()
        stack.down()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _drain_prefect_workers() -> None:
    """Send queued logs and events while the server is still up; otherwise exit waits on retries."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=10)


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    return tmp_path / "store"
