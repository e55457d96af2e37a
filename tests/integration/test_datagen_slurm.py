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

import dask

# Loads distributed's config defaults now: a dask.config.set made before they load drops the whole 'distributed'
# section when its context ends.
import distributed  # noqa: F401
import pytest

from factory.inference.fault_server import FaultServer
from factory.slurm_cluster import ClusterFault
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
    from flows.inference import register_endpoints

    block = _save_block("test-datagen", tmp_path, min_jobs=1, max_jobs=1)
    run_id = "slurm-run"
    job_name = f"factory-test-{os.getpid()}-{run_id}"
    with FaultServer() as server, watch_queue(job_name) as seen:
        # The endpoints come the way the sglang-on-slurm flow hands them over: a saved InferenceEndpointsBlock.
        register_endpoints.fn([server.base_url], "test-datagen-endpoints")
        job = _job(tmp_path, run_id, block, 8, server)
        job["openai"]["base_url"] = "http://127.0.0.1:9/v1"  # nothing listens here: the block's URL must win
        job["datagen"]["endpoints_block"] = "test-datagen-endpoints"
        summary = intern_bootcamp_datagen(**job)

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


def _wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _first_chunk_job(store_root: Path, run_id: str) -> str | None:
    stats = _chunk_stats(store_root, run_id)
    return stats[0]["worker"]["slurm_job_id"] if stats else None


def _assert_every_group_once(store_root: Path, run_id: str, items: int) -> list[dict[str, Any]]:
    store = ShardStore(store_root)
    assert store.verify(run_id) == []
    groups = list(store.iter_groups(run_id))
    assert len(groups) == items and len({g.item_key for g in groups}) == items, "a group is missing or duplicated"
    return _chunk_stats(store_root, run_id)


def test_a_cancelled_worker_job_is_replaced_and_its_chunks_run_again(slurm: None, prefect_server: dict,
                                                                    tmp_path: Path) -> None:
    from flows.datagen import intern_bootcamp_datagen

    block = _save_block("test-scancel", tmp_path, min_jobs=2, max_jobs=2)
    run_id, data = "scancel-run", tmp_path / "data"
    job_name = f"factory-test-{os.getpid()}-{run_id}"
    cancelled: list[str] = []

    def cancel_first_job() -> None:
        job = _wait_for(lambda: _first_chunk_job(data, run_id), 300, "the first chunk")
        subprocess.run(["scancel", job], check=True)
        cancelled.append(job)

    with FaultServer() as server, watch_queue(job_name) as seen:
        server.inject(*["slow:1"] * 1000)  # each request takes a second: chunks are in flight when the job dies
        killer = threading.Thread(target=cancel_first_job, daemon=True)
        killer.start()
        # The cluster forgets a lost worker's job only after distributed.deploy.lost-worker-timeout (15 s by
        # default), and only then does adapt submit a replacement. A faster machine finished the 24 items within
        # those 15 s on the surviving job, so the test shortens the timeout: the run must outlast the replacement.
        with dask.config.set({"distributed.deploy.lost-worker-timeout": "2s"}):
            intern_bootcamp_datagen(**_job(tmp_path, run_id, block, 24, server))
        killer.join(5)

    stats = _assert_every_group_once(data, run_id, 24)
    assert cancelled and cancelled[0] in seen
    after = {s["worker"]["slurm_job_id"] for s in stats} - set(cancelled)
    assert after, "no chunk ran on another job after the cancellation"
    assert len(seen) >= 3, f"the cancelled job was not replaced: {seen}"
    assert "CANCELLED" in (tmp_path / "logs" / f"slurm-{cancelled[0]}.out").read_text()
    assert jobs_named(job_name) == []


def test_a_worker_at_the_end_of_its_lifetime_is_replaced(slurm: None, tmp_path: Path) -> None:
    """worker_lifetime < walltime: the worker leaves before SLURM would kill it, its job ends, adapt submits another.

    The cluster as the block builds it (cluster_kwargs/adapt_kwargs), without Prefect: a bare worker starts fast.
    """
    from dask.distributed import Client
    from dask_jobqueue import SLURMCluster

    from factory.slurm_cluster import SlurmClusterSpec, adapt_kwargs, cluster_kwargs

    spec = SlurmClusterSpec(job_name=f"factory-test-{os.getpid()}", cores=1, memory="1GB", walltime="00:10:00",
                            log_dir=str(tmp_path / "logs"), min_jobs=1, max_jobs=1, worker_lifetime="10s",
                            lifetime_stagger="0s")
    kwargs = cluster_kwargs(spec, run_id="lifetime")
    with SLURMCluster(**kwargs) as cluster, Client(cluster) as client, watch_queue(kwargs["job_name"]) as seen:
        cluster.adapt(**adapt_kwargs(spec))
        first = client.submit(os.getenv, "SLURM_JOB_ID", pure=False).result(timeout=240)
        assert first is not None
        _wait_for(lambda: len(seen) >= 2, 240, "a replacement job after the first worker's lifetime")
        # The replacement is a working worker in a new SLURM job.
        ran_in = _wait_for(lambda: (job := client.submit(os.getenv, "SLURM_JOB_ID", pure=False).result(timeout=240))
                           != first and job, 240, "a task on the replacement worker")
        assert ran_in in seen and first in seen
    assert "worker-lifetime-reached" in (tmp_path / "logs" / first / "worker.log").read_text()
    assert _wait_for(lambda: jobs_named(kwargs["job_name"]) == [], 60, "the cluster's jobs to end")


def test_jobs_of_a_killed_flow_are_cancelled_by_the_next_start_of_the_run(slurm: None, prefect_server: dict,
                                                                       tmp_path: Path) -> None:
    import signal
    import sys

    from flows.datagen import intern_bootcamp_datagen

    block = _save_block("test-crash", tmp_path, min_jobs=1, max_jobs=1)
    run_id, data = "crash-run", tmp_path / "data"
    job_name = f"factory-test-{os.getpid()}-{run_id}"
    with FaultServer() as server:
        server.inject(*["slow:2"] * 1000)
        job = _job(tmp_path, run_id, block, 12, server)
        code = ("import json, sys; from flows.datagen import intern_bootcamp_datagen; "
                "intern_bootcamp_datagen(**json.loads(sys.argv[1]))")
        log = tmp_path / "flow.log"
        with open(log, "wb") as out:
            flow = subprocess.Popen([sys.executable, "-c", code, json.dumps(job)], cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, env={**os.environ, **prefect_server,
                                                                   "PYTHONPATH": str(REPO)})
        try:
            commits = data / run_id / "commits.jsonl"
            _wait_for(lambda: (commits.is_file() and commits.stat().st_size) or flow.poll() is not None, 300,
                      "the killed flow's first committed chunk")
            assert flow.poll() is None, "the flow ended before it was killed:\n" + log.read_text()[-3000:]
        finally:
            flow.send_signal(signal.SIGKILL)
            flow.wait()
        orphans = set(_job_ids(job_name))
        assert orphans, "the killed flow's worker job should still be queued (it is the orphan)"
        server.faults.clear()
        summary = intern_bootcamp_datagen(**job)  # the next start of the run cancels them first, then resumes

    assert not orphans & set(_job_ids(job_name)) and jobs_named(job_name) == []
    stats = _assert_every_group_once(data, run_id, 12)
    assert summary["session_chunks"] < 6 and {s["worker"]["slurm_job_id"] for s in stats} - orphans


def test_tasks_sample_from_the_inference_server_their_job_started_on_its_node(slurm: None, prefect_server: dict,
                                                                            tmp_path: Path) -> None:
    import sys

    from flows.datagen import intern_bootcamp_datagen

    server_command = f"{sys.executable} -m factory.inference.fault_server --port {{port}}"  # SGLang on GPU nodes
    block = _save_block("test-node-local", tmp_path, min_jobs=1, max_jobs=1, node_server_command=server_command,
                        node_server_timeout_s=120)
    run_id = "node-local-run"
    with FaultServer() as unused:  # the test's own server must see no traffic
        job = _job(tmp_path, run_id, block, 4, unused)
        job["openai"]["base_url"] = "http://node-local"
        intern_bootcamp_datagen(**job)
        assert sum(unused.hits.values()) == 0

    stats = _assert_every_group_once(tmp_path / "data", run_id, 4)
    (job_id,) = {s["worker"]["slurm_job_id"] for s in stats}
    log = (tmp_path / "logs" / job_id / "worker.log").read_text()
    assert "node inference server healthy at http://127.0.0.1:" in log
    assert (tmp_path / "logs" / job_id / "server.log").is_file()


def test_a_partition_slurm_does_not_have_fails_the_run_at_once_with_sbatchs_words(slurm: None, prefect_server: dict,
                                                                                  tmp_path: Path) -> None:
    """sbatch --test-only refuses the job script before the cluster starts; the flow's retries are skipped."""
    from flows.datagen import intern_bootcamp_datagen

    block = _save_block("test-bad-partition", tmp_path, partition="no-such-partition")
    started = time.monotonic()
    with FaultServer() as server, pytest.raises(ClusterFault) as raised:
        intern_bootcamp_datagen(**_job(tmp_path, "bad-partition", block, 4, server))
    assert time.monotonic() - started < 30
    message = str(raised.value)
    assert "partition" in message and message.endswith("Invalid partition name specified"), message
    assert "invalid partition specified: no-such-partition" in message
    assert jobs_named(f"factory-test-{os.getpid()}-bad-partition") == []


def test_workers_that_die_on_start_up_fail_the_run_with_the_first_workers_error(slurm: None, prefect_server: dict,
                                                                                tmp_path: Path) -> None:
    """A python on the nodes without the environment (here: without site-packages) cannot start a Dask worker."""
    import sys

    from flows.datagen import intern_bootcamp_datagen

    block = _save_block("test-dead-workers", tmp_path, python=f"{sys.executable} -S", min_jobs=1, max_jobs=2)
    job_name = f"factory-test-{os.getpid()}-dead-workers"
    started = time.monotonic()
    with FaultServer() as server, pytest.raises(ClusterFault) as raised:
        intern_bootcamp_datagen(**_job(tmp_path, "dead-workers", block, 4, server))
    elapsed = time.monotonic() - started
    message = str(raised.value)
    assert elapsed < 60, f"{elapsed:.0f} s: {message}"
    assert "ended before its Dask worker joined" in message and "No module named 'distributed'" in message, message
    assert _wait_for(lambda: jobs_named(job_name) == [], 30, "the cluster's jobs to end")
