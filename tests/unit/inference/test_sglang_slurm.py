"""Generated SLURM job scripts and server/router commands for SGLang (no SLURM needed)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from blocks.inference import InferenceEndpointsBlock, SGLangClusterBlock
from factory.inference.sglang_slurm import (
    LOCAL_COMMAND,
    SGLangLaunchSpec,
    parse_job_id,
    render_job_script,
    router_command,
    server_command,
)


def test_default_command_is_sglang_launch_server_with_parallelism_and_memory() -> None:
    spec = SGLangLaunchSpec(model_path="/models/Qwen 7B", tp=4, dp=2, port=31000, mem_fraction_static=0.8,
                            extra_server_args=["--context-length", "8192"])
    argv = shlex.split(server_command(spec, replica=1))
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    pairs = dict(zip(argv[3::2], argv[4::2]))
    assert pairs["--model-path"] == "/models/Qwen 7B" and pairs["--tp-size"] == "4" and pairs["--dp-size"] == "2"
    assert pairs["--port"] == "31001" and pairs["--mem-fraction-static"] == "0.8"
    assert pairs["--context-length"] == "8192"


def test_launch_command_override_runs_the_local_cpu_server() -> None:
    spec = SGLangLaunchSpec(model_path="models/starter-policy", launch_command=LOCAL_COMMAND, host="127.0.0.1")
    assert shlex.split(server_command(spec, 0)) == ["python", "-m", "factory.inference.local_server", "--model",
                                                   "models/starter-policy", "--host", "127.0.0.1", "--port", "30000"]
    with pytest.raises(ValueError, match="placeholder"):
        server_command(SGLangLaunchSpec(model_path="m", launch_command="serve {model}"), 0)


def test_job_script_carries_resources_setup_endpoint_file_and_is_valid_bash(tmp_path: Path) -> None:
    spec = SGLangLaunchSpec(model_path="m", tp=2, dp=2, partition="gpu", account="rl", qos="high", mem="200G",
                            cpus_per_task=16, extra_sbatch=["--exclusive"], setup_commands=["module load cuda/12.4"],
                            time_limit="01:00:00")
    script = render_job_script(spec, tmp_path, 0, server_command(spec, 0))
    for line in ["#SBATCH --partition=gpu", "#SBATCH --account=rl", "#SBATCH --qos=high", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=16", "#SBATCH --mem=200G", "#SBATCH --exclusive", "#SBATCH --time=01:00:00",
                 f"#SBATCH --output={tmp_path / 'server-0.log'}", "module load cuda/12.4"]:
        assert line in script.splitlines()
    assert f'echo "http://${{HOST}}:30000" > "{tmp_path / "server-0.endpoint"}.tmp"' in script
    assert script.rstrip().endswith(server_command(spec, 0))
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_router_job_fronts_the_workers_without_gpus(tmp_path: Path) -> None:
    spec = SGLangLaunchSpec(model_path="m", use_router=True, router_port=30100, tp=8)
    command = router_command(spec, ["http://n1:30000", "http://n2:30001"])
    assert command.endswith("--worker-urls http://n1:30000 http://n2:30001") and "--port 30100" in command
    script = render_job_script(spec, tmp_path, None, command)
    assert "--gpus-per-node" not in script and "router.endpoint" in script


def test_bad_spec_values_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="extra_sbatch"):
        SGLangLaunchSpec(model_path="m", extra_sbatch=["exclusive"])
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangLaunchSpec(model_path="m", mem_fraction_static=1.5)


def test_sbatch_job_id_parsing() -> None:
    assert parse_job_id("1234\n") == "1234" and parse_job_id("77;cluster") == "77"
    with pytest.raises(RuntimeError, match="job id"):
        parse_job_id("sbatch: error: invalid partition")


def test_blocks_give_the_launch_spec_and_the_client_config() -> None:
    block = SGLangClusterBlock(model_path="m", tp=2, partition="gpu", use_router=True)
    spec = block.spec()
    assert spec.tp == 2 and spec.partition == "gpu" and spec.use_router
    endpoints = InferenceEndpointsBlock(base_urls=["http://a:1/v1", "http://b:2/v1"], num_max_requests_at_once=8)
    config = endpoints.inference_config(max_retries=1)
    assert config.urls == ["http://a:1/v1", "http://b:2/v1"] and config.num_max_requests_at_once == 8
