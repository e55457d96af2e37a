"""The GRPO policy, its optimizer and one training step; checkpoints as HF directories with exact resume.

`GRPOTrainer.train_step(groups)` turns a `/batch` into micro-batches, accumulates
gradients with the step-level token weights (so the loss does not depend on
the micro-batch size), clips the global norm, and steps AdamW and the warmup
schedule. `save(dir)` writes `model.safetensors`, config, tokenizer and chat
template (a directory any HF loader or the policy server reads) plus
`trainer_state.pt` (optimizer, scheduler, RNG states, step); `restore(dir)`
brings all of it back, so a resumed run computes exactly what an unbroken
one would have.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from factory.train.batch import MicroBatch, StepBatch, micro_batches, to_sequences
from factory.train.config import TrainSettings
from factory.train.loss import grpo_token_loss, token_logprobs

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
CHECKPOINT_PREFIX = "step-"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def accumulate(totals: dict[str, float], sums: dict[str, float]) -> None:
    """Add one micro-batch's loss sums into the step's totals (min/max for the ratio bounds)."""
    for key, value in sums.items():
        if key == "ratio_min":
            totals[key] = min(totals.get(key, float("inf")), value)
        elif key == "ratio_max":
            totals[key] = max(totals.get(key, float("-inf")), value)
        else:
            totals[key] = totals.get(key, 0.0) + value


def step_metrics(step: int, batch: StepBatch, t: dict[str, float], grad_norm: float, lr: float,
                 compute_s: float) -> dict[str, Any]:
    """The metrics row of optimizer step `step` from the whole batch and the step's summed loss totals."""
    n = max(t.get("tokens", 0.0), 1.0)
    scores = batch.scores
    mean = sum(scores) / len(scores)
    std = (sum((s - mean) ** 2 for s in scores) / len(scores)) ** 0.5
    all_tokens = sum(len(s.inputs) + 1 for s in batch.sequences)
    lag = (step - 1 - min(batch.policy_versions)) if batch.policy_versions else None
    return {
        "step": step,
        "loss": t.get("loss", 0.0),
        "reward_mean": mean,
        "reward_std": std,
        "groups": batch.groups,
        "sequences": len(batch.sequences),
        "zero_adv_frac": batch.zero_advantage_groups / max(batch.groups, 1),
        "clip_frac": t.get("clipped", 0.0) / n,
        "capped_frac": t.get("capped", 0.0) / n,
        "ratio_mean": t.get("ratio_sum", 0.0) / n,
        "ratio_min": t["ratio_min"] if t.get("tokens") else 1.0,
        "ratio_max": t["ratio_max"] if t.get("tokens") else 1.0,
        "logprob_diff_abs": t.get("logprob_diff_abs_sum", 0.0) / n,
        "kl": t.get("kl_sum", 0.0) / n,
        "entropy": t.get("entropy_sum", 0.0) / n,
        "grad_norm": grad_norm,
        "lr": lr,
        "trained_tokens": int(t.get("tokens", 0)),
        "tokens": all_tokens,
        "tokens_per_s": all_tokens / compute_s if compute_s > 0 else None,
        "compute_s": compute_s,
        "policy_lag": lag,
    }


class GRPOTrainer:
    """Model + optimizer + schedule; `step` counts optimizer steps taken."""

    def __init__(self, cfg: TrainSettings, model_path: str | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.device = pick_device(cfg.device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        path = model_path or cfg.model_path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
        self.model.train()
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext())
        self.ref_model = None
        if cfg.loss.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=torch.float32).to(self.device)
            self.ref_model.eval().requires_grad_(False)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        warmup = o.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        self.step = 0

    # ---- training ----
    def _micro_loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        with self.autocast:
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        logp, entropy = token_logprobs(logits, mb.targets)
        behaviour = torch.where(torch.isnan(mb.behaviour_logp), logp.detach(), mb.behaviour_logp)
        ref = mb.ref_logp
        if ref is None and self.ref_model is not None:
            with torch.no_grad(), self.autocast:
                ref_logits = self.ref_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            ref = token_logprobs(ref_logits, mb.targets)[0]
        out = grpo_token_loss(logp, behaviour, mb.advantages, mb.weights, mb.mask, self.cfg.loss,
                              ref_logp=ref, entropy=entropy)
        return out.loss, out.sums

    def train_step(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        """One optimizer step on one batch of groups; returns the step's metrics."""
        started = time.perf_counter()
        batch: StepBatch = to_sequences(groups, scale_rewards=self.cfg.loss.scale_rewards, std_eps=self.cfg.loss.std_eps)
        if not batch.sequences:
            raise ValueError("the batch has no sequence of at least 2 tokens; nothing to train on")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {"ratio_min": float("inf"), "ratio_max": float("-inf")}
        for mb in micro_batches(batch.sequences, self.cfg.optim.micro_batch_size, self.cfg.loss.aggregation, self.pad_id):
            mb = mb.to(self.device)
            loss, sums = self._micro_loss(mb)
            loss.backward()
            accumulate(totals, sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        compute_s = time.perf_counter() - started
        return self._metrics(batch, totals, float(grad_norm), lr, compute_s)

    def _metrics(self, batch: StepBatch, t: dict[str, float], grad_norm: float, lr: float, compute_s: float) -> dict[str, Any]:
        return step_metrics(self.step, batch, t, grad_norm, lr, compute_s)

    # ---- checkpoints ----
    def save(self, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write the checkpoint to a hidden temp dir, then rename it into place (a reader never sees half of one)."""
        final = Path(directory)
        tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.model.save_pretrained(tmp, safe_serialization=True)
        self.tokenizer.save_pretrained(tmp)
        torch.save({
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "extra": extra or {},
        }, tmp / STATE_FILE)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return final

    def restore(self, directory: str | Path) -> dict[str, Any]:
        """Load weights, optimizer, scheduler, RNG and step from a checkpoint written by `save`; returns `extra`."""
        from safetensors.torch import load_file

        directory = Path(directory)
        weights = load_file(str(directory / "model.safetensors"), device=str(self.device))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        real_missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if real_missing or unexpected:
            raise RuntimeError(f"checkpoint {directory} does not fit the model: missing {real_missing}, unexpected {unexpected}")
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()
        state = torch.load(directory / STATE_FILE, map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        return state.get("extra", {})


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:08d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under output_dir/checkpoints (complete = renamed into place with its state)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if p.name.startswith(CHECKPOINT_PREFIX) and (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)), default=None)


def prune_checkpoints(output_dir: str | Path, keep: int) -> None:
    root = Path(output_dir) / "checkpoints"
    done = sorted((p for p in root.iterdir() if p.name.startswith(CHECKPOINT_PREFIX)),
                  key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
