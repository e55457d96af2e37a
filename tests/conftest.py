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
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from factory.local_prefect import temporary_local_prefect

    with temporary_local_prefect(tmp_path_factory.mktemp("prefect-home"), free_port()) as environ:
        with temporary_settings(updates={PREFECT_API_URL: environ["PREFECT_API_URL"]}):
            yield environ


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    return tmp_path / "store"
