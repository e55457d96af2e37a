"""Blocks that say where the `grpo-train` flow starts its torchrun job: local processes or a SLURM job.

    LocalTorchrunBlock(nproc_per_node=8).save("one-node")
    SlurmTorchrunBlock(partition="gpu", nodes=4, gpus_per_node=8, walltime="12:00:00").save("gpu-4x8")
    # then, with no code change:  grpo-train ... launcher_block=factory-slurm-torchrun/gpu-4x8

The fields are `factory.train.launch`'s specs (one definition for the block and
the plain code); `spec()` returns that plain spec for `launch()`.
"""

from __future__ import annotations

from prefect.blocks.core import Block

from factory.train.launch import LocalLaunchSpec, SlurmLaunchSpec


class LocalTorchrunBlock(Block, LocalLaunchSpec):
    """torchrun on the machine the flow runs on (a laptop, one GPU node)."""

    _block_type_name = "Factory Local Torchrun"

    def spec(self) -> LocalLaunchSpec:
        return LocalLaunchSpec(**{name: getattr(self, name) for name in LocalLaunchSpec.model_fields})


class SlurmTorchrunBlock(Block, SlurmLaunchSpec):
    """One sbatch job of `nodes` nodes x `gpus_per_node` (or `processes_per_node`) ranks."""

    _block_type_name = "Factory SLURM Torchrun"

    def spec(self) -> SlurmLaunchSpec:
        return SlurmLaunchSpec(**{name: getattr(self, name) for name in SlurmLaunchSpec.model_fields})
