"""The trainer's config: the `train.`, `source.` and `push.` sections of a `train-grpo` job (YAML + dotted CLI)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from factory.config import FactoryConfig


class LossConfig(FactoryConfig):
    """How groups become advantages and tokens become a loss."""

    scale_rewards: bool = Field(False, description="Divide group-centred rewards by the group's std (Dr.GRPO: off).")
    std_eps: float = Field(1e-6, gt=0, description="Added to the std when scale_rewards is on.")
    clip_low: float = Field(0.2, ge=0, description="Ratio below 1 - clip_low is clipped (PPO epsilon).")
    clip_high: float = Field(0.28, ge=0, description="Ratio above 1 + clip_high is clipped (DAPO's clip-higher).")
    is_cap: float = Field(2.0, gt=1, description="Truncated importance weight: the ratio counts at most this much "
                                                 "(dual clip on negative advantages); bounds train/inference mismatch.")
    aggregation: Literal["token_mean", "sequence_mean"] = Field(
        "token_mean", description="token_mean: every trained token weighs the same; sequence_mean: every sequence does.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL to the frozen reference policy; 0 loads no reference.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight (entropy is always logged).")


class OptimConfig(FactoryConfig):
    """AdamW with linear warmup, gradient clipping and accumulation."""

    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warmup from 0 to lr; constant after.")
    max_grad_norm: float = Field(1.0, gt=0, description="Clip the global gradient norm to this.")
    micro_batch_size: int = Field(16, ge=1, description="Sequences per forward/backward; a step accumulates micro-batches.")


class LoraSettings(FactoryConfig):
    """`train.lora.`: optional LoRA adapters (peft) on the policy; only the adapters train."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights (needs the `lora` extra: peft).")
    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input (0 keeps steps deterministic).")
    target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                      description="Linear layers (by name suffix) that get adapters.")
    push: Literal["merged", "adapter"] = Field(
        "merged", description="merged: weight dirs hold base + B@A*scale as plain HF weights (any server loads them); "
                              "adapter: they hold the adapter only (adapter_model.safetensors + adapter_config.json).")


class DistSettings(FactoryConfig):
    """`train.dist.`: the torch.distributed trainer (used when the flow runs under torchrun)."""

    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="Process-group backend; auto: nccl on CUDA, else gloo.")
    timeout_s: float = Field(600.0, gt=0, description="A collective that waits longer than this fails the job "
                                                       "(covers a hung rank; a dead rank is ended by torchrun at once).")
    reshard_after_forward: bool = Field(True, description="FSDP2: free gathered layers after forward (ZeRO-3); "
                                                          "False keeps them until backward (ZeRO-2, more memory, less traffic).")
    keep_weights: int = Field(2, ge=1, description="HF weight directories (for inference) kept under output_dir/weights.")
    load: Literal["rank0", "every_rank"] = Field(
        "rank0", description="rank0: only rank 0 reads the checkpoint (host RAM: one copy per node), the others build "
                             "the model on the meta device and receive their shards by broadcast; every_rank: each "
                             "rank reads it (simpler, one full copy per rank in host RAM).")


class TrainSettings(FactoryConfig):
    """The `train.` section: model, steps, checkpoints, device."""

    model_path: str = Field("models/starter-policy", description="HF model directory to start from.")
    output_dir: str = Field("./checkpoints/grpo", description="Checkpoints, metrics.jsonl and the reward curve go here.")
    batch_size: int = Field(64, ge=1, description="Sequences per optimizer step (what /register asks the API for).")
    max_token_len: int = Field(512, ge=1, description="Longest sequence the trainer accepts (sent to /register).")
    total_steps: int = Field(100, ge=1, description="Stop after this many optimizer steps.")
    max_runtime_s: float | None = Field(None, gt=0, description="Stop (after a checkpoint) once this much wall time has passed.")
    checkpoint_every: int = Field(5, ge=1, description="Save a checkpoint (and push weights) every K steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Most recent checkpoints kept on disk (older ones deleted).")
    seed: int = Field(0, description="Seed of torch/python RNGs at a fresh start.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA with bf16 autocast when present, else CPU.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's own choice / OMP_NUM_THREADS).")
    gradient_checkpointing: bool = Field(False, description="Recompute decoder layers in backward (less activation memory).")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="Optional LoRA adapters (distributed trainer).")
    dist: DistSettings = Field(default_factory=DistSettings, description="torch.distributed settings (under torchrun).")
    loss: LossConfig = Field(default_factory=LossConfig, description="Advantages and loss.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and schedule.")
    wandb: bool = Field(False, description="Also log metrics to Weights & Biases (only if wandb is installed).")
    wandb_project: str = Field("rollout-factory", description="W&B project when wandb is on.")


class SourceSettings(FactoryConfig):
    """The `source.` section: where batches come from."""

    kind: Literal["api", "store"] = Field("api", description="api: an Atropos-compatible batching API; store: shards offline.")
    api_url: str = Field("http://127.0.0.1:8000", description="Batching API root for kind=api.")
    api_token: str | None = Field(None, description="Bearer token for the API, if it needs one.")
    poll_s: float = Field(0.5, gt=0, description="Seconds between /batch polls while the API has no batch.")
    max_wait_s: float = Field(600.0, gt=0, description="Give up when no batch arrives for this long.")
    store_root: str = Field("./data", description="Shard store root for kind=store.")
    runs: list[str] = Field(default_factory=list, description="Store runs read in order for kind=store.")


class PushSettings(FactoryConfig):
    """The `push.` section: inference endpoints that get each checkpoint."""

    endpoints: list[str] = Field(default_factory=list, description="SGLang-compatible roots; each gets /update_weights_from_disk.")
    timeout_s: float = Field(120.0, gt=0, description="Seconds one endpoint may take to load a checkpoint.")
    background: bool = Field(False, description="Push on a background thread while the next steps train (at most one "
                             "push in flight; the trainer waits only if the previous push has not finished).")


class TrainJobConfig(FactoryConfig):
    """A whole `train-grpo` job."""

    train: TrainSettings = Field(default_factory=TrainSettings, description="Model, steps, checkpoints.")
    source: SourceSettings = Field(default_factory=SourceSettings, description="Where batches come from.")
    push: PushSettings = Field(default_factory=PushSettings, description="Where new weights go.")
