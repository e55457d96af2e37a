"""The `rl-loop` flow end to end on a tiny budget, started the way a user starts it from the UI: `prefect deploy`
of the `rl-loop` entry in prefect.yaml, a process worker, `prefect deployment run rl-loop/rl-loop`. Real Prefect
server, policy server, batching API, datagen flow and trainer flow; asserts that reward rows and eval rows were
written, that training never drew an eval problem, and that the report artifact exists."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

TINY = {"families": ["modulo", "sorting"], "difficulties": [1], "total_steps": 2, "batch_size": 16, "group_size": 4,
        "checkpoint_every": 1, "warmup_steps": 0, "eval_per_family": 6, "min_eval_problems": 1, "datagen_items": 400,
        "chunk_items": 4, "max_tokens": 16, "seed": 3}


def prefect(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_rl_loop_deployment_run_writes_reward_and_eval_rows(prefect_server: dict[str, str], tmp_path: Path) -> None:
    from prefect.artifacts import Artifact

    env = {**os.environ, **prefect_server, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    deployed = prefect("--no-prompt", "deploy", "--name", "rl-loop", env=env)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    out = tmp_path / "run"
    worker_log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "local-process",
                               "--type", "process"], cwd=REPO, env=env, stdout=worker_log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        run = prefect("deployment", "run", "rl-loop/rl-loop", "--params",
                      json.dumps({"loop": {**TINY, "out_dir": str(out)}}), "--watch", "--watch-timeout", "400",
                      env=env, timeout=450)
        log = (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:] + log
    finally:
        os.killpg(worker.pid, signal.SIGINT)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
        worker_log.close()

    report = json.loads((out / "report.json").read_text())
    metrics = [json.loads(line) for line in Path(report["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2] and all("reward_mean" in r for r in metrics)
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    heads = {(r["phase"], r["level"], r["temperature"]) for r in rows if r["family"] == "headline"}
    assert heads == {(p, lv, t) for p in ("before", "after") for lv in (1, 2) for t in (0.0, 1.0)}
    assert all(r["n"] > 0 and r["ci95"][0] <= r["accuracy"] <= r["ci95"][1] for r in rows)
    assert report["overlap_planned"] == 0 and report["overlap_trained"] == 0 and report["problems_made"] > 0
    assert report["steps"] == 2 and 0 < report["busy_share"] <= 1.0 and report["policy_lag_max"] is not None
    assert (out / "report.png").stat().st_size > 1000 and "95% CI" in (out / "report.md").read_text()
    assert Artifact.get("rl-loop-report") is not None
