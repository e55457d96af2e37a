"""The distributed trainer's own checkpoints: sharded model + optimizer + progress through torch.distributed.checkpoint.

One `Stateful` (`TrainerCheckpoint`) holds all of it; `get_state_dict` /
`set_state_dict` turn FSDP2's sharded tensors into DCP's global layout, so a
checkpoint saved by N ranks loads on M ranks (resharded). Layout:

    <output_dir>/dcp/step-00000004/   .metadata + __<rank>_0.distcp shards, written by every rank

Each save goes to a hidden temporary directory that rank 0 renames into place
after every rank finished, so a directory named `step-*` is always complete.
These are not for inference: `factory/train/weights.py` writes the plain HF
weight directories the servers load.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from factory.train.world import World

logger = logging.getLogger(__name__)

PREFIX = "step-"


class TrainerCheckpoint(Stateful):
    """Model, optimizer and progress (step, scheduler, the step's metrics row) as one DCP state."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, progress: dict[str, Any]) -> None:
        self.model, self.optimizer, self.scheduler, self.progress = model, optimizer, scheduler, progress

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sched = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        return {"model": model_sd, "optim": optim_sd,
                "progress": json.dumps({**self.progress, "scheduler": sched}, default=str)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        progress = json.loads(state["progress"])
        sched = progress.pop("scheduler")
        current = self.scheduler.state_dict()
        current.update(sched)
        self.scheduler.load_state_dict(current)
        self.progress.clear()
        self.progress.update(progress)


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "dcp" / f"{PREFIX}{step:08d}"


def latest(output_dir: str | Path) -> Path | None:
    """The newest complete DCP checkpoint (renamed into place, with its .metadata)."""
    root = Path(output_dir) / "dcp"
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / ".metadata").is_file()]
    return max(done, key=lambda p: int(p.name.removeprefix(PREFIX)), default=None)


def save(state: TrainerCheckpoint, output_dir: str | Path, step: int, world: World) -> Path:
    """Every rank writes its shards to a temporary directory; rank 0 renames it to step-N once all are done."""
    import torch.distributed.checkpoint as dcp

    final = checkpoint_path(output_dir, step)
    tmp = final.with_name(f".tmp-{final.name}")
    if world.is_master:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    world.barrier()
    dcp.save({"trainer": state}, checkpoint_id=str(tmp))
    world.barrier()
    if world.is_master:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    world.barrier()
    return final


def load(state: TrainerCheckpoint, directory: str | Path) -> None:
    """Restore `state` from a checkpoint saved on any number of ranks."""
    import torch.distributed.checkpoint as dcp

    dcp.load({"trainer": state}, checkpoint_id=str(directory))


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` `step-*` directories under `root` (rank 0 only)."""
    if not root.is_dir():
        return
    done = sorted((p for p in root.iterdir() if p.name.startswith(PREFIX)),
                  key=lambda p: int(p.name.removeprefix(PREFIX)))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
