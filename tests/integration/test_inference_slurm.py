"""SGLang-on-SLURM path on a real (one-node) SLURM cluster, with the local CPU server standing in for SGLang.

Needs slurmctld/slurmd/munge installed; the fixture starts the local cluster
(deployments/slurm/local_cluster.sh, as root) when it is not running, and
skips when SLURM is not installed.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import httpx
import pytest

from factory.inference.client import InferenceClient, InferenceConfig
from factory.inference.sglang_slurm import SGLangCluster, SGLangLaunchSpec
from factory.inference.tiny_model import make_tiny_policy
from factory.inference.types import SamplingParams
from tests.conftest import free_port
from tests.integration.conftest import jobs_named as _jobs_named

pytestmark = [pytest.mark.integration, pytest.mark.slurm]
REPO = Path(__file__).resolve().parents[2]


def free_port_run(count: int = 2) -> int:
    """A port p with p..p+count-1 all free: replica i listens on port + i (a free_port() + 1 was taken once in CI)."""
    for _ in range(50):
        base = free_port()
        sockets = []
        try:
            for offset in range(count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"found no {count} consecutive free ports")


def _spec(model: Path, **overrides) -> SGLangLaunchSpec:
    return SGLangLaunchSpec(
        model_path=str(model), host="127.0.0.1", port=free_port_run(), time_limit="00:10:00", health_timeout_s=120,
        gpus_per_node=0,  # the CPU stand-in needs no GPU (this node has none)
        launch_command=f"{sys.executable} -m factory.inference.local_server --model {{model_path}} --host {{host}} "
                       "--port {port}",
        setup_commands=[f"cd {REPO}", "export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1"], **overrides)


def test_replicas_start_serve_and_are_cancelled_on_exit(slurm: None, tmp_path: Path) -> None:
    model = make_tiny_policy(tmp_path / "model")
    spec = _spec(model, replicas=2, job_name=f"factory-test-{os.getpid()}")
    cluster = SGLangCluster(spec, tmp_path / "run")
    with cluster as endpoints:
        assert len(endpoints) == 2 and len(_jobs_named(spec.job_name)) == 2

        async def sample():
            async with InferenceClient(InferenceConfig(base_url=endpoints)) as client:
                return await asyncio.gather(*(client.generate([1, 2, 3], n=2, sampling=SamplingParams(max_tokens=4))
                                              for _ in range(8)))

        results = asyncio.run(sample())
        assert {c.endpoint for r in results for c in r} == {u.rstrip("/") for u in endpoints}
    assert _jobs_named(spec.job_name) == []
    with pytest.raises(httpx.HTTPError):
        httpx.get(endpoints[0] + "/health", timeout=2)


def test_router_job_is_the_single_endpoint(slurm: None, tmp_path: Path) -> None:
    model = make_tiny_policy(tmp_path / "model")
    spec = _spec(model, use_router=True, router_port=free_port(), job_name=f"factory-router-{os.getpid()}",
                 # stand-in router: the instant server (sglang_router is not installed here)
                 router_command=f"{sys.executable} -m factory.inference.fault_server --port {{port}}")
    with SGLangCluster(spec, tmp_path / "run") as endpoints:
        assert endpoints == [f"http://{os.uname().nodename}:{spec.router_port}"]
        script = (tmp_path / "run" / "router.sbatch").read_text()
        assert "fault_server" in script
    assert _jobs_named(spec.job_name) == []


def test_a_server_that_dies_fails_fast_with_its_log_and_nothing_is_left_running(slurm: None, tmp_path: Path) -> None:
    spec = _spec(tmp_path / "no-such-model", job_name=f"factory-dead-{os.getpid()}")
    with pytest.raises(RuntimeError, match="ended before it was healthy") as caught:
        with SGLangCluster(spec, tmp_path / "run"):
            pass
    assert "server-0.log" in str(caught.value) and "config.json" in str(caught.value)
    assert _jobs_named(spec.job_name) == []


def test_flow_registers_the_endpoints_as_a_block_and_tears_down(slurm: None, prefect_server: dict,
                                                                tmp_path: Path) -> None:
    from blocks.inference import InferenceEndpointsBlock
    from flows.inference import sglang_on_slurm

    model = make_tiny_policy(tmp_path / "model")
    spec = _spec(model, job_name=f"factory-flow-{os.getpid()}")
    endpoints = sglang_on_slurm(spec=spec, run_dir=str(tmp_path / "run"), hold_s=0, register_as="test-sglang")
    assert endpoints == [f"http://{os.uname().nodename}:{spec.port}"]
    block = InferenceEndpointsBlock.load("test-sglang")
    assert block.base_urls == [endpoints[0] + "/v1"] and block.inference_config().server_type == "sglang"
    assert _jobs_named(spec.job_name) == []
