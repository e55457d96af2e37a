"""Shared fixtures: offline Hugging Face, a real local Prefect server for tests that need one."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Tokenizer decoders the export CLIs save (factory/export/decode_cache.py): not into ~/.cache from tests; the export
# tests that exercise them point this at their tmp dir.
os.environ.setdefault("FACTORY_DECODE_CACHE", "off")
# Inherited by every process the tests start: pytest_sessionfinish fails the run if one outlives the tests.
os.environ.setdefault("FACTORY_TEST_SESSION", f"{os.getpid()}-{time.time_ns()}")
# Run from a venv (scripts/setup.sh's ./.venv) without activating it, `.venv/bin/python -m pytest`: what the tests
# start by name (`python` in SLURM job scripts, console scripts such as run-api) must be the venv's all the same.
if sys.prefix != sys.base_prefix and os.environ.get("PATH", "").split(os.pathsep)[0] != os.path.dirname(sys.executable):
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when processes started by the tests are still running (they are ended and listed)."""
    import sys

    from tests.process_leaks import reap_leaks

    spared: set[int] = set()
    if "prefect.server.api.server" in sys.modules:  # Prefect's temporary server stops at exit, after this check
        from prefect.server.api.server import SubprocessASGIServer

        spared = {s.server_process.pid for s in SubprocessASGIServer._instances.values() if s.server_process}

    if "tasks.scoring_pool" in sys.modules:  # the shared scorer pool closes at exit; close it now, as exit would
        sys.modules["tasks.scoring_pool"].ScorerPool.close_all()
    import psutil

    for child in psutil.Process().children():  # multiprocessing's own helpers end with this interpreter
        try:
            if any(f"multiprocessing.{helper} import main" in " ".join(child.cmdline())
                   for helper in ("forkserver", "resource_tracker")):
                spared.add(child.pid)
        except psutil.Error:
            pass

    factory = getattr(session.config, "_tmp_path_factory", None)
    basetemp = getattr(factory, "_basetemp", None)  # set only when a test used tmp_path
    paths = (str(basetemp),) if basetemp is not None and basetemp.exists() else ()
    found = reap_leaks(os.environ["FACTORY_TEST_SESSION"], paths=paths, spare=spared)
    if not found:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(found)} process(es) started by the tests outlived them (now ended):", *found]
    if reporter is not None:
        reporter.write_sep("=", "processes left running", red=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print("\n".join(lines))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
