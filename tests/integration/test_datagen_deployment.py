"""`prefect deploy` + `prefect deployment run intern-bootcamp-datagen` on a real local server and process worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from factory.store import ShardStore

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def prefect(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_deployment_run_completes_and_its_shards_are_readable(prefect_server, tmp_path):
    from factory.inference.local_server import start_local_server
    from factory.inference.tiny_model import make_tiny_policy

    env = {**os.environ, **prefect_server, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    deployed = prefect("--no-prompt", "deploy", "--name", "intern-bootcamp-datagen", env=env)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr

    model = make_tiny_policy(tmp_path / "policy")
    worker_log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "local-process",
                               "--type", "process"], cwd=REPO, env=env, stdout=worker_log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        with start_local_server(model) as server:
            params = {
                "env": {"group_size": 4, "total_items": 8, "max_tokens": 8, "tokenizer_name": str(model),
                        "ensure_scores_are_not_same": False},
                "openai": {"base_url": server.base_url},
                "datagen": {"store_root": str(tmp_path / "data"), "run_id": "deployed", "chunk_items": 4,
                            "score_workers": 1},
            }
            run = prefect("deployment", "run", "intern-bootcamp-datagen/intern-bootcamp-datagen",
                          "--params", json.dumps(params), "--watch", "--watch-timeout", "300", env=env, timeout=360)
            log = (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:] + log
            assert "Completed" in run.stdout
    finally:
        os.killpg(worker.pid, signal.SIGINT)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
        worker_log.close()
    store = ShardStore(tmp_path / "data")
    assert store.verify("deployed") == []
    groups = list(store.iter_groups("deployed"))
    assert len(groups) == 8 and all(g.group_size == 4 for g in groups)
