"""The spine on a real local Prefect server: the stack comes up and down, a flow commits shards through the task."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from factory.local_prefect import LocalPrefect
from factory.store import ShardStore
from factory.synthetic import synthetic_groups
from tests.conftest import free_port

pytestmark = pytest.mark.integration


def test_factory_local_up_status_down(tmp_path):
    env = {**os.environ, "FACTORY_HOME": str(tmp_path / "home"), "FACTORY_PREFECT_PORT": str(free_port())}
    cli = [sys.executable, "-m", "factory.local_prefect"]
    try:
        up = subprocess.run([*cli, "up"], env=env, capture_output=True, text=True, timeout=180)
        assert up.returncode == 0, up.stderr
        status = subprocess.run([*cli, "status"], env=env, capture_output=True, text=True, timeout=30).stdout
        assert "healthy: True" in status and "worker_pid: None" not in status
        stack = LocalPrefect(home=tmp_path / "home", port=int(env["FACTORY_PREFECT_PORT"]))
        pool = subprocess.run(
            [sys.executable, "-m", "prefect", "work-pool", "inspect", "local-process"],
            env={**env, **stack.environ()}, capture_output=True, text=True, timeout=60,
        )
        assert pool.returncode == 0 and "process" in pool.stdout
    finally:
        down = subprocess.run([*cli, "down"], env=env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 0
    status = subprocess.run([*cli, "status"], env=env, capture_output=True, text=True, timeout=30).stdout
    assert "healthy: False" in status and "server_pid: None" in status and "worker_pid: None" in status


def test_flow_commits_shards_via_task_and_rerun_skips(prefect_server, tmp_path):
    from prefect import flow

    from tasks.shards import write_shard_task

    @flow(name="spine-smoke")
    def smoke(root: str) -> list[bool]:
        futures = [
            write_shard_task.submit(root, "smoke", "w0", chunk, list(synthetic_groups(4, start=chunk * 4, seq_len=8)))
            for chunk in range(3)
        ]
        return [future.result().skipped for future in futures]

    root = str(tmp_path / "store")
    assert smoke(root) == [False, False, False]
    assert smoke(root) == [True, True, True]
    store = ShardStore(root)
    assert store.count("smoke") == 12
    assert len({g.group_id for g in store.iter_groups("smoke")}) == 12

    from prefect.client.orchestration import get_client

    async def completed_runs() -> int:
        async with get_client() as client:
            runs = await client.read_flow_runs()
            return sum(1 for run in runs if run.state and run.state.is_completed())

    assert asyncio.run(completed_runs()) >= 2
