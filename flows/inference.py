"""SGLang on SLURM: submit the server jobs, wait until healthy, register the endpoints, tear down at the end.

    python flows/inference.py --block my-sglang --hold-s 3600 --register-as sglang-endpoints

The flow keeps the servers up for `hold_s` seconds (or until the run is
cancelled), then cancels the jobs; on any failure the jobs are cancelled too.
While up, the endpoints are saved as an `InferenceEndpointsBlock` named
`register_as`, so datagen deployments point their `openai` section at them.
Other flows use `sglang_endpoints(spec, run_dir)` to hold servers for their
own duration.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger, task

from blocks.inference import InferenceEndpointsBlock, SGLangClusterBlock
from factory.inference.sglang_slurm import SGLangCluster, SGLangLaunchSpec


@task(name="register-endpoints", retries=2, retry_delay_seconds=2)
def register_endpoints(endpoints: list[str], name: str) -> str:
    """Save the endpoints as an InferenceEndpointsBlock; returns the block's document name."""
    block = InferenceEndpointsBlock(base_urls=[url.rstrip("/") + "/v1" for url in endpoints])
    block.save(name, overwrite=True)
    return name


@task(name="start-sglang")
def start_cluster(cluster: SGLangCluster) -> list[str]:
    return cluster.start()


@task(name="stop-sglang")
def stop_cluster(cluster: SGLangCluster) -> None:
    cluster.stop()


@contextmanager
def sglang_endpoints(spec: SGLangLaunchSpec, run_dir: str | Path) -> Iterator[list[str]]:
    """Servers up for the duration of a `with` block (inside a flow); cancelled on exit or failure."""
    cluster = SGLangCluster(spec, run_dir)
    try:
        yield start_cluster(cluster)
    finally:
        stop_cluster(cluster)


@flow(name="sglang-on-slurm")
def sglang_on_slurm(block: str | None = None, spec: SGLangLaunchSpec | None = None, run_dir: str = "./.factory/sglang",
                    hold_s: float = 0.0, register_as: str | None = "sglang-endpoints") -> list[str]:
    """Start the servers described by the SGLangClusterBlock `block` (or `spec`), hold them, tear them down."""
    logger = get_run_logger()
    if (block is None) == (spec is None):
        raise ValueError("give exactly one of block (a saved SGLangClusterBlock name) or spec")
    launch = SGLangClusterBlock.load(block).spec() if block else spec
    with sglang_endpoints(launch, run_dir) as endpoints:
        logger.info("SGLang endpoints up: %s", ", ".join(endpoints))
        if register_as:
            register_endpoints(endpoints, register_as)
        time.sleep(hold_s)
    return endpoints


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Start SGLang servers on SLURM from a saved SGLangClusterBlock.")
    parser.add_argument("--block", required=True, help="name of a saved 'Factory SGLang Cluster' block")
    parser.add_argument("--run-dir", default="./.factory/sglang", help="shared directory for job scripts and logs")
    parser.add_argument("--hold-s", type=float, default=3600.0, help="seconds to keep the servers up")
    parser.add_argument("--register-as", default="sglang-endpoints", help="InferenceEndpointsBlock name to save")
    args = parser.parse_args(argv)
    sglang_on_slurm(block=args.block, run_dir=args.run_dir, hold_s=args.hold_s, register_as=args.register_as)


if __name__ == "__main__":
    from factory.cli_errors import run_cli

    raise SystemExit(run_cli("python -m flows.inference", main))
