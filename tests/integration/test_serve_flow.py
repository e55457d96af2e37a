"""The Prefect `serve` flow runs the same service on a real local Prefect server and stops after N steps."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from factory.serve.client import TrainerClient
from factory.serve.config import ServeConfig
from factory.store import ShardStore
from factory.synthetic import synthetic_groups
from tests.conftest import free_port

pytestmark = pytest.mark.integration


def test_serve_flow_serves_a_followed_run_and_reports(prefect_server, tmp_path):
    from flows.serve import serve

    store = ShardStore(tmp_path)
    groups = list(synthetic_groups(8, group_size=4, seq_len=16))
    store.commit("gen", "w", 0, groups)
    port = free_port()
    config = ServeConfig(host="127.0.0.1", port=port, store_root=str(tmp_path), follow_runs=["gen"], batch_metadata=True)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(serve(config, stop_after_steps=2, max_runtime_s=90)))
    runner.start()
    trainer = TrainerClient(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            trainer.register(16)
            break
        except httpx.TransportError:
            time.sleep(0.2)
    served = [g["group_id"] for _ in range(2) for g in trainer.batch()]
    runner.join(timeout=60)
    assert sorted(served) == sorted(g.group_id for g in groups)
    assert result["current_step"] == 2 and result["served_groups"] == 8 and result["queue_size"] == 0
