"""The training loop on many ranks (torchrun): rank 0 pulls each batch and broadcasts it, every rank trains its share.

    check world size -> init process group -> load + shard policy -> resume from the newest DCP checkpoint
    [ rank 0: next_batch -> broadcast -> train_step on all ranks -> rank 0: metrics row
      every K steps: DCP save (all ranks) -> HF weights gathered to rank 0's CPU -> rank 0 pushes them ]*

    torchrun --nproc-per-node 2 -m flows.train --config deployments/train_grpo.yaml --train.total_steps 10

Resume is "run the same command again", with any number of ranks: the newest
complete checkpoint under `<output_dir>/dcp` restores the sharded model,
optimizer, schedule and step, resharded to the new world size; the metrics file
is cut back to that step and the source restarts there (same rules as the
single-process loop in loop.py). A rank that dies ends the job: torchrun
stops the others as soon as it sees a worker exit.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from factory.config import ConfigError
from factory.train import dcp
from factory.train.config import TrainJobConfig
from factory.train.dist_trainer import DistGRPOTrainer, WorldSizeError, check_world
from factory.train.loop import batch_fingerprint, make_source
from factory.train.metrics import MetricsLog, open_wandb, plot_reward_curve
from factory.train.push import push_weights
from factory.train.sharding import ModelLoadError, build_policy, build_reference, check_model_dir, count_parameters
from factory.train.sources import BudgetSpent, NoMoreBatches
from factory.train.weights import export_weights, latest_weights
from factory.train.world import World

logger = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - reported as one line
        first = (str(error).strip().splitlines() or [""])[0]
        raise ModelLoadError(f"train.model_path {path!r}: its tokenizer does not load: {type(error).__name__}: "
                             f"{first[:300]}") from error


def run_distributed(cfg: TrainJobConfig, *, stop_after_steps: int | None = None) -> dict[str, Any]:
    """Train on every rank of the torchrun job until total_steps / max_runtime_s / the source runs dry."""
    t = cfg.train
    world = World.from_env(t.device)
    check_world(t.batch_size, world.world_size)
    check_model_dir(t.model_path)
    if t.threads:
        torch.set_num_threads(t.threads)
    out = Path(t.output_dir)
    world.init(t.dist.backend, t.dist.timeout_s)
    source = None
    try:
        tokenizer = load_tokenizer(t.model_path)
        torch.manual_seed(t.seed)  # the same initial LoRA adapters on every rank (and for every rank count)
        model = build_policy(t, world)
        ref = build_reference(t, world) if t.loss.kl_coef > 0 and not t.lora.enabled else None
        trainer = DistGRPOTrainer(t, world, model, tokenizer, ref)
        progress: dict[str, Any] = {"step": 0}
        state = dcp.TrainerCheckpoint(model, trainer.optimizer, trainer.scheduler, progress)
        resumed_from = world.broadcast(dcp.latest(out) if world.is_master else None)
        if resumed_from is not None:
            dcp.load(state, resumed_from)
            trainer.step = int(progress["step"])
        if world.is_master:
            logger.info("policy %s: %s on %d rank(s); %s", t.model_path, count_parameters(model), world.world_size,
                        f"resumed from {resumed_from} at step {trainer.step}" if resumed_from else "fresh start")
        metrics = None
        if world.is_master:
            out.mkdir(parents=True, exist_ok=True)
            metrics = MetricsLog(out / "metrics.jsonl",
                                 wandb_run=open_wandb(t.wandb, t.wandb_project, cfg.model_dump(mode="json")))
            metrics.resume(trainer.step)
            saved_row = progress.get("metrics_row")
            if saved_row and not any(r.get("step") == trainer.step for r in metrics.rows()):
                metrics.append(saved_row)
            pushed = latest_weights(out)
            if resumed_from is not None and cfg.push.endpoints and pushed is not None:
                push_weights(cfg.push.endpoints, pushed, trainer.step, timeout_s=cfg.push.timeout_s)
            source = make_source(cfg)
            source.start(trainer.step)
        started = time.monotonic()
        session_steps, stop_reason, last_saved = 0, "total_steps", resumed_from
        while trainer.step < t.total_steps:
            if stop_after_steps is not None and session_steps >= stop_after_steps:
                return {"step": trainer.step, "stop_reason": "stop_after_steps", "checkpoint": str(last_saved)}
            groups, wait_s, reason = None, 0.0, None
            if world.is_master:
                if t.max_runtime_s is not None and time.monotonic() - started >= t.max_runtime_s:
                    reason = "max_runtime_s"
                else:
                    waited = time.perf_counter()
                    until = started + t.max_runtime_s if t.max_runtime_s is not None else None
                    try:
                        groups = source.next_batch(until=until)
                    except BudgetSpent as error:
                        logger.info("%s", error)
                        reason = "max_runtime_s"
                    except NoMoreBatches as error:
                        logger.warning("%s", error)
                        reason = "no_more_batches"
                    wait_s = time.perf_counter() - waited
            groups, reason = world.broadcast((groups, reason))
            if reason is not None:
                stop_reason = reason
                break
            row = trainer.train_step(groups)
            row.update(wait_s=wait_s, batch=batch_fingerprint(groups), time=time.time())
            session_steps += 1
            if trainer.step % t.checkpoint_every == 0 or trainer.step == t.total_steps:
                row.update(checkpoint(cfg, trainer, state, row))
                last_saved = dcp.checkpoint_path(out, trainer.step)
            if metrics is not None:
                metrics.append(row)
                logger.info("step %d: reward %.3f, loss %.4f, grad %.3f, wait %.2fs, compute %.2fs, %.0f tok/s/rank",
                            row["step"], row["reward_mean"], row["loss"], row["grad_norm"], wait_s, row["compute_s"],
                            row["tokens_per_s_per_rank"] or 0)
        if last_saved is None or Path(last_saved).name != dcp.checkpoint_path(out, trainer.step).name:
            checkpoint(cfg, trainer, state)
            last_saved = dcp.checkpoint_path(out, trainer.step)
        summary: dict[str, Any] = {"step": trainer.step, "stop_reason": stop_reason, "checkpoint": str(last_saved),
                                   "weights": str(latest_weights(out)), "world_size": world.world_size,
                                   "session_steps": session_steps, "seconds": round(time.monotonic() - started, 2)}
        if metrics is not None:
            curve = plot_reward_curve(metrics.rows(), out / "reward_curve.png")
            summary.update(metrics=str(metrics.path), curve=str(curve) if curve else None)
            (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        if source is not None:
            source.close()
        world.shutdown()


def checkpoint(cfg: TrainJobConfig, trainer: DistGRPOTrainer, state: dcp.TrainerCheckpoint,
               row: dict[str, Any] | None = None) -> dict[str, Any]:
    """Collective: DCP save (with the step's metrics row), HF weights for inference, prune, push (rank 0)."""
    t, world = cfg.train, trainer.world
    began = time.perf_counter()
    state.progress.update(step=trainer.step, metrics_row=dict(row) if row else None)
    path = dcp.save(state, t.output_dir, trainer.step, world)
    save_s = time.perf_counter() - began
    began = time.perf_counter()
    weights = export_weights(trainer.model, trainer.tokenizer, t, trainer.step, world)
    export_s = time.perf_counter() - began
    push_s = 0.0
    if world.is_master:
        dcp.prune(Path(t.output_dir) / "dcp", t.keep_checkpoints)
        dcp.prune(Path(t.output_dir) / "weights", t.dist.keep_weights)
        if cfg.push.endpoints:
            push_s = push_weights(cfg.push.endpoints, weights, trainer.step, timeout_s=cfg.push.timeout_s)
    return {"checkpoint": str(path), "weights": str(weights), "save_s": save_s, "export_s": export_s, "push_s": push_s}


SETUP_ERRORS = (ConfigError, WorldSizeError, ModelLoadError)


def main_distributed(args: list[str]) -> int:
    """Entry point of one torchrun rank: config from YAML + dotted CLI; setup errors end every rank with one line."""
    from factory.config import build_config, split_config_path

    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s %(message)s", force=True)
    try:
        yaml_path, overrides = split_config_path(args)
        cfg = build_config(TrainJobConfig, yaml_path=yaml_path, cli_args=overrides)
        summary = run_distributed(cfg)
    except SETUP_ERRORS as error:
        if rank == 0:
            print(f"train-grpo: error: {error}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        print(json.dumps(summary), flush=True)
    return 0
