"""Shared integration fixtures: the one-node SLURM cluster (deployments/slurm/local_cluster.sh) and a tiny policy server."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def slurm() -> None:
    """A running SLURM controller and node: started (as root) when installed but down, else the test is skipped."""
    if shutil.which("sbatch") is None or shutil.which("slurmctld") is None:
        pytest.skip("SLURM is not installed (apt-get install slurmctld slurmd slurm-client munge)")
    if subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        if os.geteuid() != 0:
            pytest.skip("SLURM is not running and starting it needs root (deployments/slurm/local_cluster.sh up)")
        subprocess.run(["bash", str(REPO / "deployments/slurm/local_cluster.sh"), "up"], check=True, timeout=120)


def jobs_named(prefix: str) -> list[str]:
    """Names of queued or running SLURM jobs that start with `prefix`."""
    out = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True).stdout.split()
    return [name for name in out if name.startswith(prefix)]


@pytest.fixture(scope="module")
def policy_server(tmp_path_factory):
    """A local policy server on a tiny random policy: (base_url, model path); one per test module."""
    from factory.inference.local_server import start_local_server
    from factory.inference.tiny_model import make_tiny_policy

    model = make_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny")
    with start_local_server(model) as handle:
        yield handle.base_url, str(model)
