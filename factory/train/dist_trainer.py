"""One GRPO step on many ranks: the same advantages, loss and token weights as `GRPOTrainer`, the batch split by rank.

    groups (same on every rank) -> sequences -> token weights over the WHOLE step
      -> sequences sorted by length, dealt round-robin to ranks (rank r gets r, r+W, r+2W, ...)
      -> per rank: micro-batches of its share, loss * W, backward (FSDP2 reduce-scatters the mean of the ranks' grads)
      -> clip the global grad norm, AdamW, warmup schedule

The weights are computed over the whole batch before it is split, and FSDP
averages gradients over W ranks, so scaling each rank's loss by W makes the
gradient the sum of per-token terms of the whole step: the step does not
depend on the rank count or the micro-batch size (up to float summation order).
Every rank runs the same number of forward/backward passes (FSDP's
collectives must match); a rank with fewer sequences runs a zero-weight
micro-batch. Loss totals are summed over ranks for the metrics row.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from factory.train.batch import MicroBatch, StepBatch, TrainSequence, collate, micro_batches, to_sequences, token_weights
from factory.train.config import TrainSettings
from factory.train.loss import grpo_token_loss, token_logprobs
from factory.train.trainer import accumulate, step_metrics
from factory.train.world import World

logger = logging.getLogger(__name__)

SUM_KEYS = ("tokens", "clipped", "capped", "ratio_sum", "logprob_diff_abs_sum", "kl_sum", "entropy_sum", "loss")


class WorldSizeError(ValueError):
    """The batch cannot be split evenly over the ranks; the message names both numbers."""


def check_world(batch_size: int, world_size: int) -> None:
    """Fail before loading anything when train.batch_size is not a multiple of the rank count."""
    if batch_size % world_size:
        raise WorldSizeError(f"train.batch_size {batch_size} is not divisible by the world size {world_size}: "
                             f"use a batch size that is a multiple of {world_size} or another --nproc-per-node")


def rank_share(sequences: list[TrainSequence], weights: list[float], rank: int, world_size: int
               ) -> tuple[list[TrainSequence], list[float]]:
    """This rank's sequences (longest first, dealt round-robin: lengths stay balanced) with their step weights."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i].inputs))
    mine = order[rank::world_size]
    return [sequences[i] for i in mine], [weights[i] for i in mine]


def micro_batch_count(n_sequences: int, world_size: int, size: int) -> int:
    """Forward/backward passes every rank runs: those of the rank with the most sequences (rank 0)."""
    return max(1, math.ceil(math.ceil(n_sequences / world_size) / size))


class DistGRPOTrainer:
    """Sharded policy + optimizer + schedule on one rank; `step` counts optimizer steps taken."""

    def __init__(self, cfg: TrainSettings, world: World, model: torch.nn.Module, tokenizer: Any,
                 ref_model: torch.nn.Module | None = None) -> None:
        self.cfg, self.world, self.model, self.tokenizer, self.ref_model = cfg, world, model, tokenizer, ref_model
        o = cfg.optim
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        warmup = o.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        self.step = 0

    def _reference_logp(self, mb: MicroBatch) -> torch.Tensor | None:
        if mb.ref_logp is not None or self.cfg.loss.kl_coef <= 0:
            return mb.ref_logp
        with torch.no_grad():
            if self.ref_model is not None:
                logits = self.ref_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            else:  # LoRA: the base model is the policy with its adapters switched off
                with self.model.disable_adapter():
                    logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        return token_logprobs(logits, mb.targets)[0]

    def _micro_loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        logp, entropy = token_logprobs(logits, mb.targets)
        behaviour = torch.where(torch.isnan(mb.behaviour_logp), logp.detach(), mb.behaviour_logp)
        out = grpo_token_loss(logp, behaviour, mb.advantages, mb.weights, mb.mask, self.cfg.loss,
                              ref_logp=self._reference_logp(mb), entropy=entropy)
        return out.loss, out.sums

    def plan(self, batch: StepBatch) -> list[tuple[MicroBatch, bool]]:
        """This rank's micro-batches, each with `real` (False: a zero-weight pass that keeps ranks in step)."""
        weights = token_weights(batch.sequences, self.cfg.loss.aggregation)
        mine, my_weights = rank_share(batch.sequences, weights, self.world.rank, self.world.world_size)
        size = self.cfg.optim.micro_batch_size
        planned = [(mb, True) for mb in (micro_batches(mine, size, self.cfg.loss.aggregation, self.pad_id, my_weights)
                                         if mine else [])]
        for _ in range(micro_batch_count(len(batch.sequences), self.world.world_size, size) - len(planned)):
            planned.append((collate([batch.sequences[0]], [0.0], self.pad_id), False))
        return planned

    def train_step(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        """One optimizer step on one batch (the same `groups` on every rank); returns the step's metrics row."""
        started = time.perf_counter()
        batch = to_sequences(groups, scale_rewards=self.cfg.loss.scale_rewards, std_eps=self.cfg.loss.std_eps)
        if not batch.sequences:
            raise ValueError("the batch has no sequence of at least 2 tokens; nothing to train on")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for mb, real in self.plan(batch):
            loss, sums = self._micro_loss(mb.to(self.world.device))
            (loss * self.world.world_size).backward()
            if real:
                accumulate(totals, sums)
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                                                   self.cfg.optim.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        totals = self._reduce(totals)
        if self.world.device.type == "cuda":
            torch.cuda.synchronize()
        compute_s = time.perf_counter() - started
        row = step_metrics(self.step, batch, totals, float(grad_norm), lr, compute_s)
        row.update(world_size=self.world.world_size,
                   tokens_per_s_per_rank=row["tokens"] / compute_s / self.world.world_size if compute_s > 0 else None)
        return row

    def _reduce(self, totals: dict[str, float]) -> dict[str, float]:
        sums = self.world.all_reduce([totals.get(k, 0.0) for k in SUM_KEYS], "sum")
        low = self.world.all_reduce([totals.get("ratio_min", float("inf"))], "min")[0]
        high = self.world.all_reduce([totals.get("ratio_max", float("-inf"))], "max")[0]
        return {**dict(zip(SUM_KEYS, sums)), "ratio_min": low, "ratio_max": high}
