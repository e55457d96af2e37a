"""The `grpo-train` flow with its infrastructure chosen by a block: a SLURM job of 2 ranks on the one-node cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from factory.inference.tiny_model import make_tiny_policy
from factory.store import ShardStore
from factory.train.launch import LaunchError, check_partition
from tests.unit.train.test_resume import _groups

pytestmark = [pytest.mark.integration, pytest.mark.slurm]


def test_a_partition_that_does_not_exist_fails_before_sbatch(slurm: None):
    with pytest.raises(LaunchError, match="SLURM partition 'no-such-partition' does not exist; known partitions: "):
        check_partition("no-such-partition")


def test_grpo_train_deployment_trains_two_ranks_in_a_slurm_job(slurm: None, prefect_server: dict, tmp_path: Path):
    from blocks.train_launch import SlurmTorchrunBlock
    from flows.grpo_train import grpo_train

    policy = make_tiny_policy(tmp_path / "policy")
    store = ShardStore(tmp_path / "store")
    store.commit("toy", "p", 0, _groups(8))
    SlurmTorchrunBlock(processes_per_node=2, cpus_per_task=2, walltime="00:10:00", job_name="grpo-train-test",
                       environment={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}).save("test-2ranks", overwrite=True)
    out = tmp_path / "out"
    summary = grpo_train(
        train={"model_path": str(policy), "output_dir": str(out), "batch_size": 8, "total_steps": 2,
               "checkpoint_every": 2, "threads": 1, "optim": {"micro_batch_size": 4}},
        source={"kind": "store", "store_root": str(tmp_path / "store"), "runs": ["toy"]},
        launcher_block="factory-slurm-torchrun/test-2ranks")
    assert summary["step"] == 2 and summary["world_size"] == 2 and summary["job_id"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and {r["world_size"] for r in rows} == {2}
    assert (out / "weights" / "step-00000002" / "WEIGHTS_READY").is_file()
    log = Path(summary["log"]).read_text()
    assert f"grpo-train job {summary['job_id']}: 1 node(s)" in log and "[rank 0]" in log
    assert Path(summary["log"]).with_suffix(".exit").read_text().strip() == "0"
