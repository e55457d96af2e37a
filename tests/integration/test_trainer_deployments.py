"""The trainer and store deployments run the way a user runs them: `prefect deploy`, a process worker, a deployment run.

train-grpo (the in-process trainer) and grpo-train (a torchrun job of 2 gloo ranks on CPU) each train 2 steps of
the shipped starter policy (models/starter-policy, the deployment's own model path) on batches from a run-api the
test starts, following a store run of synthetic groups; train-grpo pushes its checkpoint to a policy server.
`compact` merges a small store's shards. All three run at once on one worker, from a checkout-like directory, so
the deployments' relative paths (deployments/train_grpo.yaml, ./checkpoints, data/store) resolve as in a clone.

Not run here: atropos-env (an Atropos venv: tests/integration/test_atropos_env.py) and the SLURM deployments.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from factory.store import ShardStore
from factory.synthetic import synthetic_groups
from tests.conftest import free_port
from tests.integration.test_datagen_deployment import checkout_like, client_env, prefect, process_worker
from tests.integration.test_deployments import run_logs, wait_for

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
STEPS = 2
TRAIN = {"total_steps": STEPS, "batch_size": 8, "checkpoint_every": STEPS, "threads": 1,
         "optim": {"micro_batch_size": 8, "warmup_steps": 0}}
"""Tiny training on top of deployments/train_grpo.yaml: 2 steps of 8 sequences (2 groups of 4)."""


def api_following(store: Path, log: Path) -> Any:
    """run-api serving the groups of the store's run `gen` (committed before it starts), for a `with` block."""
    from factory.serve.client import ApiProcess

    ShardStore(store).commit("gen", "p", 0, synthetic_groups(16, group_size=4, seq_len=12, vocab=250, seed=5))
    port = free_port()
    return ApiProcess([sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1",
                       "--store_root", str(store), "--follow_runs", "[gen]", "--follow_interval_s", "0.1",
                       "--log_level", "warning"], port, log_path=str(log))


def artifact(client: Any, run_id: Any, key: str) -> Any:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]),
                                                                 flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])),
                                  limit=5)
    assert found, f"no artifact {key!r} on run {run_id}"
    return found[0]


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_trainer_and_compact_deployments_run_from_a_checkout(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from factory.inference.local_server import start_local_server
    from factory.train.trainer import checkpoint_dir, latest_checkpoint

    env, work = client_env(prefect_server), checkout_like(tmp_path)
    started = time.monotonic()
    deployed = prefect("--no-prompt", "deploy", "--name", "train-grpo", "--name", "grpo-train", "--name", "compact",
                       env=env, cwd=work)
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    timings = {"deploy": round(time.monotonic() - started, 1)}

    store = ShardStore(work / "data/store")  # the compact deployment's store_root, relative to the checkout
    for chunk in range(6):
        store.commit("small", "w0", chunk, synthetic_groups(4, start=chunk * 4, group_size=2, seq_len=8))
    before = sorted(g.group_id for g in store.iter_groups("small"))
    assert len(store.shard_paths("small")) == 6

    with api_following(tmp_path / "api-1", tmp_path / "api-1.log") as api_1, \
            api_following(tmp_path / "api-2", tmp_path / "api-2.log") as api_2, \
            start_local_server(REPO / "models/starter-policy") as server, \
            process_worker("local-process", env=env, cwd=work, log=tmp_path / "worker.log"):
        source = {"poll_s": 0.05, "max_wait_s": 60}
        runs = {
            "train-grpo": run_deployment("train-grpo/train-grpo", timeout=0, parameters={
                "train": TRAIN, "source": {**source, "api_url": api_1.url},
                "push": {"endpoints": [server.base_url]}}).id,
            "grpo-train": run_deployment("grpo-train/grpo-train", timeout=0, parameters={
                "train": {**TRAIN, "optim": {"micro_batch_size": 4, "warmup_steps": 0}},
                "source": {**source, "api_url": api_2.url}, "push": {"endpoints": []}}).id,
            "compact": run_deployment("compact/compact", timeout=0, parameters={"target_mb": 1, "flush": True}).id,
        }
        with get_client(sync_client=True) as client:
            final = wait_for(client, runs, timeout=300)
            timings["runs"] = round(time.monotonic() - started, 1)
            worker_log = (tmp_path / "worker.log").read_text(errors="replace")
            report = {name: (run.state.type.value, run.state.message, round(run.total_run_time.total_seconds(), 1))
                      for name, run in final.items()}
            print(json.dumps({"timings_s": timings, "runs": report}))
            for name, run in final.items():
                assert run.state.is_completed(), (name, report[name], worker_log[-4000:])
            # What each run promises: its summary on the run, its checkpoint and metrics where the deployment says.
            assert artifact(client, final["train-grpo"].id, "train-grpo-summary").data
            assert artifact(client, final["grpo-train"].id, "grpo-train-summary").data
            compact_logs = [log.message for log in run_logs(client, final["compact"].id)]
            assert any(line.startswith("small: merged 6 shards (24 groups") for line in compact_logs), compact_logs
        # train-grpo pushed its last checkpoint to the policy server, which now serves it as version = step.
        assert httpx.get(f"{server.base_url}/get_weight_version").json()["weight_version"] == str(STEPS)

    single = work / "checkpoints/grpo"  # deployments/train_grpo.yaml's output_dir
    assert [r["step"] for r in metrics(single)] == [1, 2]
    assert latest_checkpoint(single) == checkpoint_dir(single, STEPS)
    dist = work / "checkpoints/grpo-dist"  # the grpo-train deployment's train.output_dir
    rows = metrics(dist)
    assert [r["step"] for r in rows] == [1, 2] and {r["world_size"] for r in rows} == {2}
    assert (dist / "weights" / f"step-{STEPS:08d}" / "WEIGHTS_READY").is_file()

    fresh = ShardStore(work / "data/store")
    assert fresh.verify("small") == [] and len(fresh.shard_paths("small")) == 1
    assert sorted(g.group_id for g in fresh.iter_groups("small")) == before
