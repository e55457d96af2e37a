"""Model setup for the distributed trainer: load any `AutoModelForCausalLM` directory, optional LoRA and
gradient checkpointing, then FSDP2 `fully_shard` on every decoder block and on the root.

Blocks are found through the model's own `_no_split_modules` (the class names
Hugging Face marks as "keep on one device": the decoder layers), so no
per-architecture code is needed. On CUDA the parameters are kept in float32
and computed in bf16 (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`);
on CPU everything is float32. By default only rank 0 reads the checkpoint (into
CPU memory); the other ranks build the model on the meta device, and after
sharding rank 0 broadcasts the weights tensor by tensor, each rank keeping its
shard (`train.dist.load: every_rank` reads it on every rank instead).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from factory.train.config import TrainSettings
from factory.train.world import World

logger = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The model directory cannot be loaded as a causal LM; the message names the path and the cause."""


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"


def check_model_dir(path: str) -> None:
    """Cheap check before the process group starts: a directory with a config.json that transformers can read."""
    from transformers import AutoConfig

    if not Path(path).is_dir() or not (Path(path) / "config.json").is_file():
        raise ModelLoadError(f"train.model_path {path!r} is not a Hugging Face model directory (no config.json there); "
                             "point it at a directory written by save_pretrained")
    try:
        AutoConfig.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - any loader failure is reported as one line
        raise ModelLoadError(f"train.model_path {path!r} does not load: its config.json is not one transformers "
                             f"reads: {_first_line(error)}") from error


def load_causal_lm(path: str) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained(path)` in float32 on CPU, with one clear error if it does not load."""
    from transformers import AutoModelForCausalLM

    check_model_dir(path)
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001 - any loader failure is reported as one line
        raise ModelLoadError(f"train.model_path {path!r} does not load as AutoModelForCausalLM: "
                             f"{_first_line(error)}") from error


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules whose class is in the (base) model's `_no_split_modules`: one FSDP unit each."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        logger.warning("%s names no _no_split_modules; sharding the whole model as one unit", type(base).__name__)
    return blocks


def shard_model(model: nn.Module, world: World, *, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 over all ranks: each decoder block its own unit, the rest (embeddings, norm, head) in the root unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(world.device.type, (world.world_size,))
    if world.device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model


def empty_causal_lm(path: str) -> nn.Module:
    """The model of `path`'s config on the meta device: structure only, no memory (filled by `broadcast_weights`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_model_dir(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)


def broadcast_weights(model: nn.Module, full: dict[str, torch.Tensor] | None, world: World) -> None:
    """Collective after sharding: rank 0's full weights become every rank's shards; buffers are copied from rank 0.

    The other ranks' modules are on the meta device until `to_empty` gives their shards memory on this rank's
    device; `set_model_state_dict(broadcast_from_rank0=True)` then sends one tensor at a time. Buffers are not
    sharded and some (rotary frequencies) are not in the state dict, so they are broadcast as they are.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not world.is_master:
        model.to_empty(device=world.device)
    set_model_state_dict(model, full if world.is_master else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for _, buffer in model.named_buffers():
        dist.broadcast(buffer, src=0)


def _load(cfg: TrainSettings, world: World, path: str, prepare) -> nn.Module:
    """Load (all ranks, or rank 0 + meta elsewhere), `prepare` (LoRA, checkpointing, freezing), shard, fill."""
    rank0_only = cfg.dist.load == "rank0" and world.world_size > 1
    model = load_causal_lm(path) if (world.is_master or not rank0_only) else empty_causal_lm(path)
    model = prepare(model)
    full = dict(model.state_dict()) if rank0_only and world.is_master else None  # the unsharded tensors, by reference
    shard_model(model, world, reshard_after_forward=cfg.dist.reshard_after_forward)
    if rank0_only:
        broadcast_weights(model, full, world)
    del full
    return model


def build_policy(cfg: TrainSettings, world: World, path: str | None = None) -> nn.Module:
    """The trainable policy: loaded, LoRA-wrapped when asked, checkpointed when asked, sharded."""

    def prepare(model: nn.Module) -> nn.Module:
        if cfg.lora.enabled:
            from factory.train.lora import apply_lora

            model = apply_lora(model, cfg.lora)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(model, "config"):
                model.config.use_cache = False
        return model.train()

    return _load(cfg, world, path or cfg.model_path, prepare)


def build_reference(cfg: TrainSettings, world: World) -> nn.Module:
    """The frozen reference policy for the KL term, sharded the same way (no gradients, no optimizer state)."""
    return _load(cfg, world, cfg.model_path, lambda model: model.eval().requires_grad_(False))


def count_parameters(model: nn.Module) -> dict[str, Any]:
    """Total and trainable parameter counts of the full (unsharded) model."""
    def numel(p: torch.Tensor) -> int:
        return p.numel()  # a DTensor reports its global size

    params = list(model.parameters())
    return {"params": sum(numel(p) for p in params), "trainable": sum(numel(p) for p in params if p.requires_grad)}
