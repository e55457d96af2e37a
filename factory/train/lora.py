"""LoRA adapters through peft: wrap the policy, and turn a gathered state dict into what inference loads.

Only the adapters train (peft freezes the base weights), so the optimizer
holds state for a small fraction of the parameters. For a weight push the
full state dict gathered on rank 0 is either merged (W + B @ A * alpha / r,
plain HF names: any server loads it as a normal checkpoint) or cut down to
the adapter tensors in peft's own file layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from factory.train.config import LoraSettings

PEFT_PREFIX = "base_model.model."


def apply_lora(model: nn.Module, cfg: LoraSettings) -> nn.Module:
    """`peft.get_peft_model` with a LoraConfig built from `cfg`."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError("train.lora.enabled needs peft: pip install 'rollout-factory[lora]' (or pip install peft)") from error
    config = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
                        bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _strip(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX)


def merged_state_dict(full: dict[str, torch.Tensor], cfg: LoraSettings) -> dict[str, torch.Tensor]:
    """peft-named full weights -> plain HF weights with every adapter merged into its base layer."""
    scale = cfg.alpha / cfg.r
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        if ".lora_A." in name or ".lora_B." in name or ".lora_dropout" in name:
            continue
        if ".base_layer." in name:
            module, _, leaf = name.rpartition(".base_layer.")
            if leaf == "weight":
                a = full[f"{module}.lora_A.default.weight"].float()
                b = full[f"{module}.lora_B.default.weight"].float()
                tensor = (tensor.float() + (b @ a) * scale).to(tensor.dtype)
            out[_strip(f"{module}.{leaf}")] = tensor
        else:
            out[_strip(name)] = tensor
    return out


def adapter_state_dict(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, named as peft's `save_pretrained` names them (no adapter name)."""
    return {name.replace(".default.", "."): t for name, t in full.items() if ".lora_A." in name or ".lora_B." in name}


def write_adapter_config(directory: Path, cfg: LoraSettings, base_model: str) -> None:
    """adapter_config.json as peft writes it for a LoRA adapter, so `PeftModel.from_pretrained` reads the directory."""
    from peft import LoraConfig

    config = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
                        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model)
    data = config.to_dict()
    data = {k: (sorted(v) if isinstance(v, set) else v) for k, v in data.items()}
    (directory / "adapter_config.json").write_text(json.dumps(data, indent=2, default=str))
