"""The `grpo-train` launcher without a cluster: infrastructure resolution, the sbatch script, following a job's log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from factory.config import ConfigError
from factory.train.launch import Job, LocalLaunchSpec, SlurmLaunchSpec, failure_line, follow, sbatch_script
from flows.grpo_train import GrpoTrainParams, resolve_launcher, world_size_of

ROOT = Path(__file__).resolve().parents[3]


def test_no_block_is_local_torchrun_with_the_flow_s_rank_count():
    spec = resolve_launcher(GrpoTrainParams(nproc_per_node=4))
    assert isinstance(spec, LocalLaunchSpec) and world_size_of(spec) == 4
    with pytest.raises(ConfigError, match="nodes / gpus_per_node need a SLURM launcher_block"):
        resolve_launcher(GrpoTrainParams(nodes=2))


def test_slurm_world_is_nodes_times_gpus_and_the_script_says_so(tmp_path: Path):
    spec = SlurmLaunchSpec(nodes=4, gpus_per_node=8, partition="gpu", memory="200G", extra_directives=["--exclusive"])
    assert world_size_of(spec) == 32 and world_size_of(SlurmLaunchSpec(processes_per_node=2)) == 2
    script = sbatch_script(spec, tmp_path / "job.yaml", tmp_path / "train.log")
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "#SBATCH --mem=200G",
                 "#SBATCH --exclusive", "#SBATCH --ntasks-per-node=1", f"#SBATCH --output={tmp_path / 'train.log'}"):
        assert line in script.splitlines()
    assert "srun --kill-on-bad-exit=1 --ntasks-per-node=1" in script
    assert "--nnodes $SLURM_NNODES --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:$PORT" in script
    assert script.rstrip().endswith("exit $code") and str(tmp_path / "train.exit") in script
    cpu = sbatch_script(SlurmLaunchSpec(processes_per_node=2), tmp_path / "job.yaml", tmp_path / "train.log")
    assert "--gpus-per-node" not in cpu and "#SBATCH --cpus-per-task=2" in cpu


def test_follow_hands_over_log_lines_and_metrics_rows_and_the_exit_code(tmp_path: Path):
    log, metrics = tmp_path / "train.log", tmp_path / "metrics.jsonl"
    code = ("import json, time\n"
            f"m = open({str(metrics)!r}, 'a')\n"
            "for step in (1, 2):\n"
            "    print(f'[rank 0] step {step}', flush=True)\n"
            "    m.write(json.dumps({'step': step}) + '\\n'); m.flush(); time.sleep(0.2)\n"
            "print('train-grpo: error: something named', flush=True)\n"
            "raise SystemExit(3)\n")
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    lines, rows = [], []
    assert follow(Job("local", log, process=process), metrics, on_line=lines.append, on_row=rows.append,
                  poll_s=0.05) == 3
    assert lines == ["[rank 0] step 1", "[rank 0] step 2", "train-grpo: error: something named"]
    assert [r["step"] for r in rows] == [1, 2]
    assert failure_line(log) == "train-grpo: error: something named"


def test_grpo_train_deployment_is_registered_with_a_valid_config():
    from flows.train import build_train_config

    deployments = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    d = deployments["grpo-train"]
    assert d["entrypoint"] == "flows.grpo_train:grpo_train"
    params = d["parameters"]
    cfg = build_train_config(config_path=str(ROOT / params["config_path"]), values={"train": params["train"]})
    assert cfg.train.batch_size % params["nproc_per_node"] == 0
    GrpoTrainParams(**{k: params[k] for k in ("launcher_block", "nproc_per_node", "nodes", "gpus_per_node")})
    json.dumps(params)
