"""Plain Hugging Face weight directories from the sharded policy, for inference servers and evals.

`get_model_state_dict(full_state_dict=True, cpu_offload=True)` gathers one
parameter at a time: each is all-gathered from its shards, copied to rank 0's
CPU memory and freed on the device before the next, so no GPU ever holds the
whole model (rank 0 needs the model's size in host RAM; the other ranks keep
nothing). Rank 0 then writes config, tokenizer and `model.safetensors` to a
temporary directory, the marker `WEIGHTS_READY` last, and renames it to
`<output_dir>/weights/step-N`. A reader that sees the marker sees complete weights.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from factory.train.config import TrainSettings
from factory.train.world import World

logger = logging.getLogger(__name__)

MARKER = "WEIGHTS_READY"
PREFIX = "step-"


def weights_path(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "weights" / f"{PREFIX}{step:08d}"


def latest_weights(output_dir: str | Path) -> Path | None:
    """The newest weight directory whose marker file exists."""
    root = Path(output_dir) / "weights"
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / MARKER).is_file()]
    return max(done, key=lambda p: int(p.name.removeprefix(PREFIX)), default=None)


def gather_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full state dict on rank 0's CPU (empty on the other ranks), one parameter at a time."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_weights(model: nn.Module, tokenizer, cfg: TrainSettings, step: int, world: World) -> Path:
    """Collective: write the policy at `step` as an HF directory (rank 0 writes); returns its path on every rank."""
    from safetensors.torch import save_file

    final = weights_path(cfg.output_dir, step)
    started = time.perf_counter()
    full = gather_full_state(model)
    if world.is_master:
        tmp = final.with_name(f".tmp-{final.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if cfg.lora.enabled and cfg.lora.push == "adapter":
            from factory.train.lora import adapter_state_dict, write_adapter_config

            save_file({k: v.contiguous() for k, v in adapter_state_dict(full).items()},
                      str(tmp / "adapter_model.safetensors"))
            write_adapter_config(tmp, cfg.lora, str(Path(cfg.model_path).resolve()))
        else:
            if cfg.lora.enabled:
                from factory.train.lora import merged_state_dict

                full = merged_state_dict(full, cfg.lora)
            if getattr(base.config, "tie_word_embeddings", False):
                full.pop("lm_head.weight", None)  # tied to the embeddings; loaders re-tie it
            save_file({k: v.contiguous() for k, v in full.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            base.config.save_pretrained(tmp)
            if getattr(base, "generation_config", None) is not None:
                base.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name in os.listdir(tmp):
            os.chmod(tmp / name, 0o644)  # servers may run as another user on a shared filesystem
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        (tmp / MARKER).write_text(json.dumps({"step": step, "time": time.time()}) + "\n")
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        logger.info("weights of step %d -> %s in %.2fs", step, final, time.perf_counter() - started)
    del full
    world.barrier()
    return final
