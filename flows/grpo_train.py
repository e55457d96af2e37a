"""`grpo-train`: the GRPO trainer as a torchrun job on many ranks, started where a block says (local or SLURM).

    python -m flows.grpo_train --config deployments/train_grpo.yaml --nproc_per_node 2 --train.total_steps 20
    python -m flows.grpo_train --config deployments/train_grpo.yaml \
        --launcher_block factory-slurm-torchrun/gpu-4x8 --nodes 4 --gpus_per_node 8

1. build and validate the config (train., source., push. sections as in `train-grpo`), resolve paths
2. pick the infrastructure: the named block (`factory-local-torchrun/...` or `factory-slurm-torchrun/...`),
   or local torchrun with `nproc_per_node` ranks; `nodes` / `gpus_per_node` override the block's
3. check the world size divides the batch and the model directory loads, then launch `torchrun -m flows.train --config <output_dir>/job_config.yaml`
4. follow it: its log lines go to this flow run's log, its metrics rows to a progress artifact
5. publish the summary (or fail with the job's one telling line: the trainer's setup error, the dead rank)

Running it again with the same `train.output_dir` resumes from the newest DCP checkpoint, on any world size.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from pydantic import Field

from factory.config import ConfigError, FactoryConfig, build_config, deployment_sections, split_config_path
from factory.preflight import check_slurm_client, preflight_trainer
from factory.train.config import TrainJobConfig
from factory.train.dist_trainer import check_world
from factory.train.launch import LocalLaunchSpec, SlurmLaunchSpec
from factory.train.sharding import check_model_dir
from tasks.grpo import publish_train_summary_task, run_train_job_task


class GrpoTrainParams(FactoryConfig):
    """The flow's parameters besides the trainer config (flat keys: `--nproc_per_node 2`)."""

    launcher_block: str | None = Field(None, description="'<block type slug>/<name>' of a LocalTorchrunBlock or "
                                                         "SlurmTorchrunBlock; default: local torchrun.")
    nproc_per_node: int | None = Field(None, ge=1, description="Local ranks (no block), or ranks per node on SLURM CPU jobs.")
    nodes: int | None = Field(None, ge=1, description="SLURM nodes (overrides the block's).")
    gpus_per_node: int | None = Field(None, ge=0, description="SLURM GPUs = ranks per node (overrides the block's).")
    timeout_s: float | None = Field(None, gt=0, description="Cancel the job after this long (default: no limit).")


def resolve_launcher(params: GrpoTrainParams) -> LocalLaunchSpec | SlurmLaunchSpec:
    """The block's spec (or a local default) with the flow's overrides applied."""
    if params.launcher_block is None:
        spec: LocalLaunchSpec | SlurmLaunchSpec = LocalLaunchSpec()
    else:
        from prefect.blocks.core import Block

        import blocks.train_launch  # noqa: F401 - registers the block types

        try:
            spec = Block.load(params.launcher_block).spec()
        except ValueError as error:
            raise ConfigError(f"launcher_block {params.launcher_block!r} cannot be loaded ({error}); save a "
                              "LocalTorchrunBlock or SlurmTorchrunBlock under that name first") from None
    updates: dict[str, Any] = {}
    if isinstance(spec, LocalLaunchSpec):
        if params.nodes not in (None, 1) or params.gpus_per_node:
            raise ConfigError("nodes / gpus_per_node need a SLURM launcher_block; local torchrun is one node "
                              "(use nproc_per_node)")
        if params.nproc_per_node:
            updates["nproc_per_node"] = params.nproc_per_node
    else:
        if params.nodes:
            updates["nodes"] = params.nodes
        if params.gpus_per_node is not None:
            updates["gpus_per_node"] = params.gpus_per_node
        if params.nproc_per_node:
            updates["processes_per_node"] = params.nproc_per_node
    return spec.model_copy(update=updates)


def world_size_of(spec: LocalLaunchSpec | SlurmLaunchSpec) -> int:
    return spec.nproc_per_node if isinstance(spec, LocalLaunchSpec) else spec.nodes * spec.ranks_per_node


@flow(name="grpo-train", log_prints=False)
def grpo_train(train: dict[str, Any] | None = None, source: dict[str, Any] | None = None,
               push: dict[str, Any] | None = None, config_path: str | None = None, launcher_block: str | None = None,
               nproc_per_node: int | None = None, nodes: int | None = None, gpus_per_node: int | None = None,
               timeout_s: float | None = None) -> dict[str, Any]:
    """Train with GRPO on a torchrun job (local or SLURM) until `train.total_steps`; returns the summary."""
    logger = get_run_logger()
    values = deployment_sections(train=train, source=source, push=push)  # a run's keys merge into the deployment's
    cfg = build_config(TrainJobConfig, yaml_path=config_path, values=values)
    cfg.train.output_dir = str(Path(cfg.train.output_dir).resolve())
    if Path(cfg.train.model_path).exists():
        cfg.train.model_path = str(Path(cfg.train.model_path).resolve())
    params = GrpoTrainParams(launcher_block=launcher_block, nproc_per_node=nproc_per_node, nodes=nodes,
                             gpus_per_node=gpus_per_node, timeout_s=timeout_s)
    spec = resolve_launcher(params)
    if not isinstance(spec, LocalLaunchSpec):
        check_slurm_client("launcher_block", launcher_block)  # one line here, not sinfo's FileNotFoundError later
    world = world_size_of(spec)
    check_world(cfg.train.batch_size, world)
    check_model_dir(cfg.train.model_path)  # the job checks it again on its nodes; this fails before any sbatch
    preflight_trainer(cfg)  # run-api and the policy server answer, before any job is launched
    logger.info("GRPO on %s, %d rank(s) via %s, %d steps of %d sequences -> %s", cfg.train.model_path, world,
                spec.kind, cfg.train.total_steps, cfg.train.batch_size, cfg.train.output_dir)
    summary = run_train_job_task(spec, cfg, timeout_s=timeout_s)
    logger.info("stopped at step %d (%s) on %d rank(s); weights %s", summary["step"], summary["stop_reason"],
                summary["world_size"], summary["weights"])
    return publish_train_summary_task(summary, key="grpo-train-summary")


def main(argv: list[str] | None = None) -> None:
    """CLI: the trainer config's dotted keys plus the flow's flat keys (launcher_block, nproc_per_node, ...)."""
    args = list(sys.argv[1:] if argv is None else argv)
    yaml_path, rest = split_config_path(args)
    flat = {"--launcher_block", "--nproc_per_node", "--nodes", "--gpus_per_node", "--timeout_s"}
    mine: list[str] = []
    cfg_args: list[str] = []
    index = 0
    while index < len(rest):
        key = rest[index].split("=", 1)[0]
        target = mine if key in flat else cfg_args
        target.append(rest[index])
        if "=" not in rest[index] and index + 1 < len(rest) and not rest[index + 1].startswith("--"):
            target.append(rest[index + 1])
            index += 1
        index += 1
    params = build_config(GrpoTrainParams, cli_args=mine)
    cfg = build_config(TrainJobConfig, yaml_path=yaml_path, cli_args=cfg_args)
    summary = grpo_train(train=cfg.train.model_dump(mode="json"), source=cfg.source.model_dump(mode="json"),
                         push=cfg.push.model_dump(mode="json"), **params.model_dump())
    print(f"step {summary['step']} ({summary['stop_reason']}) on {summary['world_size']} rank(s): "
          f"weights {summary['weights']}, metrics {summary['metrics']}")


if __name__ == "__main__":
    main()
