"""The datagen flow with its chunks in dask-jobqueue worker jobs on the one-node SLURM, on a real Prefect server.

Inference is the instant fault server (factory/inference/fault_server.py) in
the test process, reached by the workers over localhost; the tokenizer is the
starter policy's. Jobs are 1 core each: the CI machine has 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from factory.inference.fault_server import FaultServer
from factory.store import ShardStore
from tests.integration.conftest import REPO, jobs_named

pytestmark = [pytest.mark.integration, pytest.mark.slurm]


def _job_ids(name: str) -> dict[str, str]:
    """{job id: state} of queued or running jobs called `name`."""
    out = subprocess.run(["squeue", "-h", "--name", name, "-o", "%i %T"], capture_output=True, text=True).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


@contextmanager
def watch_queue(name: str) -> Iterator[dict[str, set[str]]]:
    """Record every job id (and its states) squeue shows under `name` while the block runs."""
    seen: dict[str, set[str]] = {}
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for job, state in _job_ids(name).items():
                seen.setdefault(job, set()).add(state)
            stop.wait(0.5)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


def _chunk_stats(store_root: Path, run_id: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((store_root / run_id).glob("stats-*-0*.json"))]


def _job(tmp_path: Path, run_id: str, block: str, items: int, server: FaultServer) -> dict[str, Any]:
    return {
        "env": {"group_size": 2, "total_items": items, "max_tokens": 4, "ensure_scores_are_not_same": False,
                "tokenizer_name": str(REPO / "models/starter-policy")},
        "openai": {"base_url": server.base_url, "server_type": "sglang", "max_retries": 2},
        "datagen": {"store_root": str(tmp_path / "data"), "run_id": run_id, "chunk_items": 2, "chunks_in_flight": 2,
                    "score_mode": "inline", "task_runner_block": f"factory-slurm-cluster/{block}"},
    }


def _save_block(name: str, tmp_path: Path, **fields: Any) -> str:
    from blocks.slurm import SlurmClusterBlock

    SlurmClusterBlock(job_name=f"factory-test-{os.getpid()}", cores=1, memory="2GB", walltime="00:10:00",
                      log_dir=str(tmp_path / "logs"), environment={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                      **fields).save(name, overwrite=True)
    return name


def test_chunks_run_in_slurm_jobs_and_every_group_is_stored_once(slurm: None, prefect_server: dict,
                                                                 tmp_path: Path) -> None:
    from flows.datagen import intern_bootcamp_datagen

    block = _save_block("test-datagen", tmp_path, min_jobs=1, max_jobs=1)
    run_id = "slurm-run"
    job_name = f"factory-test-{os.getpid()}-{run_id}"
    with FaultServer() as server, watch_queue(job_name) as seen:
        summary = intern_bootcamp_datagen(**_job(tmp_path, run_id, block, 8, server))

    store = ShardStore(tmp_path / "data")
    assert store.verify(run_id) == []
    groups = list(store.iter_groups(run_id))
    assert summary["chunks_committed"] == 4 and len(groups) == summary["groups_kept"] == 8
    assert len({g.item_key for g in groups}) == 8 and len({g.group_id for g in groups}) == 8
    # Every chunk was generated inside a SLURM job that squeue showed running under the run's job name.
    stats = _chunk_stats(tmp_path / "data", run_id)
    jobs = {s["worker"]["slurm_job_id"] for s in stats}
    assert len(stats) == 4 and None not in jobs and jobs <= set(seen), (jobs, seen)
    assert all("RUNNING" in seen[job] for job in jobs)
    for job in jobs:
        log = (tmp_path / "logs" / job / "worker.log").read_text()
        assert f"factory worker job {job}" in log and "dask" in log.lower()
    # The flow's end closed the cluster: no job of the run is left.
    assert jobs_named(job_name) == []
