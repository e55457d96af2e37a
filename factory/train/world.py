"""Who this process is in a torchrun job: rank, world size, device; one place for the few collectives the loop needs.

`World.from_env()` reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
...) and `init()` starts the process group (gloo on CPU, nccl on CUDA). Code
asks `world.is_master` instead of calling `dist.get_rank()`; only the master
talks to the batching API, writes shared files and pushes weights.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def under_torchrun() -> bool:
    """True in a process torchrun (or srun with the same variables) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


@dataclass(frozen=True)
class World:
    """This rank's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @classmethod
    def from_env(cls, device: str = "auto") -> World:
        """The world torchrun describes in the environment (rank 0 of 1 outside torchrun)."""
        rank = int(os.environ.get("RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
        dev = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1)) if use_cuda else torch.device("cpu")
        return cls(rank, world_size, local_rank, local_world, dev)

    def init(self, backend: str = "auto", timeout_s: float = 600.0) -> World:
        """Start the process group (idempotent); returns self."""
        if self.distributed:
            return self
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": self.device} if self.device.type == "cuda" else {}))
        logger.info("rank %d/%d (local %d) on %s, backend %s", self.rank, self.world_size, self.local_rank,
                    self.device, backend)
        return self

    def shutdown(self) -> None:
        if self.distributed:
            dist.destroy_process_group()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        """The master's `obj` on every rank (pickled; for batches and decisions, not tensors)."""
        if not self.distributed or self.world_size == 1:
            return obj
        box = [obj if self.is_master else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Element-wise sum / min / max of a short float list over all ranks (float64 on the reduce device)."""
        if not self.distributed or self.world_size == 1:
            return list(values)
        device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
        return t.tolist()
