"""The training loop without Prefect: resume, pull a batch, step, log, checkpoint, push weights.

    source.start(step)  ->  [ next_batch  ->  train_step  ->  metrics row  ->  every K: save + push ]*

Resume is "run the same command again": the newest complete checkpoint under
`train.output_dir` restores model, optimizer, scheduler, RNG and step; the
metrics file is cut back to that step; the source is restarted at that step
(the API replays what it served since), so the batches trained after the last
checkpoint are trained again exactly once on the restored weights, and none
is skipped. After each checkpoint every inference endpoint loads it and its
policy version becomes the trainer's step.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from factory.train.config import TrainJobConfig
from factory.train.metrics import MetricsLog, open_wandb, plot_reward_curve
from factory.train.push import BackgroundPusher, push_weights
from factory.train.sources import ApiBatchSource, BudgetSpent, NoMoreBatches, StoreBatchSource
from factory.train.trainer import GRPOTrainer, checkpoint_dir, latest_checkpoint, prune_checkpoints

logger = logging.getLogger(__name__)


def batch_fingerprint(groups: list[dict[str, Any]]) -> str:
    """A short hash of a batch's tokens and scores: the same batch served twice has the same fingerprint."""
    digest = hashlib.sha256()
    for group in groups:
        for tokens in group["tokens"]:
            digest.update(",".join(map(str, tokens)).encode() + b";")
        digest.update(repr([float(s) for s in group["scores"]]).encode())
    return digest.hexdigest()[:16]


def make_source(cfg: TrainJobConfig) -> ApiBatchSource | StoreBatchSource:
    s, t = cfg.source, cfg.train
    if s.kind == "store":
        return StoreBatchSource(s.store_root, s.runs, batch_size=t.batch_size)
    return ApiBatchSource(s.api_url, batch_size=t.batch_size, max_token_len=t.max_token_len, num_steps=t.total_steps,
                          token=s.api_token, poll_s=s.poll_s, max_wait_s=s.max_wait_s)


def run_training(cfg: TrainJobConfig, *, on_step: Callable[[dict[str, Any]], None] | None = None,
                 stop_after_steps: int | None = None) -> dict[str, Any]:
    """Train until `train.total_steps` (or the wall-clock budget, or the source runs dry); returns a summary.

    `stop_after_steps` ends this session after that many steps without a final checkpoint (tests use it to
    simulate a crash between checkpoints).
    """
    t = cfg.train
    out = Path(t.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = GRPOTrainer(t)
    resumed_from = latest_checkpoint(out)
    saved_row = None
    if resumed_from is not None:
        saved_row = trainer.restore(resumed_from).get("metrics_row")
        logger.info("resumed from %s at step %d", resumed_from, trainer.step)
    else:
        random.seed(t.seed)
        torch.manual_seed(t.seed)
    metrics = MetricsLog(out / "metrics.jsonl", wandb_run=open_wandb(t.wandb, t.wandb_project, cfg.model_dump(mode="json")))
    metrics.resume(trainer.step)
    if saved_row is not None and not any(r.get("step") == trainer.step for r in metrics.rows()):
        metrics.append(saved_row)  # killed after the checkpoint, before its step's row was logged
    if resumed_from is not None and cfg.push.endpoints:
        push_weights(cfg.push.endpoints, resumed_from, trainer.step, timeout_s=cfg.push.timeout_s)
    pusher = BackgroundPusher(cfg.push.endpoints, timeout_s=cfg.push.timeout_s) if cfg.push.background else None
    source = make_source(cfg)
    source.start(trainer.step)
    started = time.monotonic()
    session_steps = 0
    stop_reason = "total_steps"
    last_saved = resumed_from
    try:
        while trainer.step < t.total_steps:
            if t.max_runtime_s is not None and time.monotonic() - started >= t.max_runtime_s:
                stop_reason = "max_runtime_s"
                break
            if stop_after_steps is not None and session_steps >= stop_after_steps:
                return {"step": trainer.step, "stop_reason": "stop_after_steps", "checkpoint": str(last_saved)}
            waited = time.perf_counter()
            until = started + t.max_runtime_s if t.max_runtime_s is not None else None
            try:
                groups = source.next_batch(until=until)
            except BudgetSpent as error:
                logger.info("%s", error)
                stop_reason = "max_runtime_s"
                break
            except NoMoreBatches as error:
                logger.warning("%s", error)
                stop_reason = "no_more_batches"
                break
            wait_s = time.perf_counter() - waited
            row = trainer.train_step(groups)
            row.update(wait_s=wait_s, batch=batch_fingerprint(groups), time=time.time())
            session_steps += 1
            if trainer.step % t.checkpoint_every == 0 or trainer.step == t.total_steps:
                row.update(_checkpoint(cfg, trainer, row, pusher))
                last_saved = checkpoint_dir(out, trainer.step)
            metrics.append(row)
            logger.info("step %d: reward %.3f, loss %.4f, clip %.3f, grad %.3f, wait %.2fs, compute %.2fs",
                        row["step"], row["reward_mean"], row["loss"], row["clip_frac"], row["grad_norm"],
                        wait_s, row["compute_s"])
            if on_step is not None:
                on_step(row)
        if last_saved is None or Path(last_saved).name != checkpoint_dir(out, trainer.step).name:
            _checkpoint(cfg, trainer, pusher=pusher)
            last_saved = checkpoint_dir(out, trainer.step)
        if pusher is not None:
            pusher.wait()  # the server serves the final checkpoint before this returns
    finally:
        source.close()
    curve = plot_reward_curve(metrics.rows(), out / "reward_curve.png")
    return {"step": trainer.step, "stop_reason": stop_reason, "checkpoint": str(last_saved),
            "metrics": str(metrics.path), "curve": str(curve) if curve else None,
            "session_steps": session_steps, "seconds": round(time.monotonic() - started, 2)}


def _checkpoint(cfg: TrainJobConfig, trainer: GRPOTrainer, row: dict[str, Any] | None = None,
                pusher: BackgroundPusher | None = None) -> dict[str, Any]:
    """Save (with the step's metrics row, restored on resume if the process dies before logging it), prune, push.

    With a background pusher, `push_s` is the time the trainer waited for the previous push, not the push itself.
    """
    began = time.perf_counter()
    path = trainer.save(checkpoint_dir(cfg.train.output_dir, trainer.step), extra={"metrics_row": dict(row)} if row else None)
    save_s = time.perf_counter() - began
    push_s = pusher.wait() if pusher is not None else 0.0  # the checkpoint it loads must outlive the prune
    prune_checkpoints(cfg.train.output_dir, cfg.train.keep_checkpoints)
    if cfg.push.endpoints and pusher is not None:
        push_s += pusher.submit(path, trainer.step)
    elif cfg.push.endpoints:
        push_s = push_weights(cfg.push.endpoints, path, trainer.step, timeout_s=cfg.push.timeout_s)
    return {"checkpoint": str(path), "save_s": save_s, "push_s": push_s}


def main(argv: list[str] | None = None) -> None:
    """`python -m factory.train.loop --config deployments/train_grpo.yaml --train.total_steps 10`: the loop without
    Prefect (the `train-grpo` flow wraps the same function)."""
    import json
    import sys

    from factory.config import build_config, split_config_path

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    yaml_path, overrides = split_config_path(list(sys.argv[1:] if argv is None else argv))
    summary = run_training(build_config(TrainJobConfig, yaml_path=yaml_path, cli_args=overrides))
    print(json.dumps(summary))


if __name__ == "__main__":
    from factory.cli_errors import run_cli

    raise SystemExit(run_cli("python -m factory.train.loop", main))
