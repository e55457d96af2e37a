"""Prefect tasks of the `train-grpo` flow (one long task trains in-process, one publishes the summary) and of the
`grpo-train` flow (one task launches and follows a torchrun job: local processes or SLURM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from factory.train.config import TrainJobConfig
from factory.train.loop import run_training
from factory.train.metrics import MetricsLog

TABLE_KEYS = ("step", "loss", "reward_mean", "reward_std", "zero_adv_frac", "clip_frac", "ratio_mean", "ratio_max",
              "kl", "entropy", "grad_norm", "tokens_per_s", "wait_s", "compute_s", "policy_lag", "push_s")


def train_grpo_plain(config: TrainJobConfig, *, progress: bool = True) -> dict[str, Any]:
    """`run_training` with a Prefect progress artifact updated every step (a chunk of real work per update)."""
    total = config.train.total_steps
    progress_id = create_progress_artifact(progress=0.0, key="train-grpo-progress",
                                           description=f"GRPO steps of {total} -> {config.train.output_dir}") if progress else None

    def on_step(row: dict[str, Any]) -> None:
        if progress_id is not None:
            update_progress_artifact(progress_id, 100.0 * row["step"] / total)

    return run_training(config, on_step=on_step)


def _fmt(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def publish_train_summary(summary: dict[str, Any], key: str = "train-grpo-summary", last: int = 50) -> dict[str, Any]:
    """A table artifact of the last `last` steps' metrics and a markdown artifact with the run's outcome."""
    rows = MetricsLog(summary["metrics"]).rows()[-last:]
    if rows:
        create_table_artifact(table=[{k: _fmt(r.get(k)) for k in TABLE_KEYS} for r in rows], key=f"{key}-steps",
                              description="GRPO per-step metrics (last steps)")
    first, final = (rows[0], rows[-1]) if rows else ({}, {})
    lines = [f"| {k} | {v} |" for k, v in summary.items()]
    if rows:
        lines.append(f"| reward_mean first→last step | {first['reward_mean']:.3f} → {final['reward_mean']:.3f} |")
    create_markdown_artifact(key=key, markdown="| item | value |\n|---|---|\n" + "\n".join(lines) + "\n",
                             description="GRPO training run")
    return summary


train_grpo_task = task(train_grpo_plain, name="train-grpo", task_run_name="train-grpo", cache_policy=NO_CACHE, retries=0)
publish_train_summary_task = task(publish_train_summary, name="publish-train-summary", retries=2, retry_delay_seconds=2)


def run_train_job(spec: Any, config: TrainJobConfig, *, progress: bool = True,
                  timeout_s: float | None = None) -> dict[str, Any]:
    """Start the torchrun job `spec` describes on `config` (saved as <output_dir>/job_config.yaml), stream its log
    and metrics into the run, and return the trainer's summary; a failed job raises with its telling log line."""
    from prefect import get_run_logger

    from factory.config import to_yaml
    from factory.train.dist_loop import SUMMARY_FILE
    from factory.train.launch import failure_line, follow, launch

    logger = get_run_logger()
    out = Path(config.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    job_config = out / "job_config.yaml"
    job_config.write_text(to_yaml(config))
    (out / SUMMARY_FILE).unlink(missing_ok=True)
    total = config.train.total_steps
    progress_id = create_progress_artifact(progress=0.0, key="grpo-train-progress",
                                           description=f"GRPO steps of {total} -> {out}") if progress else None
    job = launch(spec, job_config, out / "logs")
    logger.info("trainer job started (%s%s); log %s", job.kind, f" {job.job_id}" if job.job_id else "", job.log)

    def on_line(line: str) -> None:
        if "it/s]" not in line:  # progress bars of weight loading and shard writing
            logger.info("%s", line)

    def on_row(row: dict[str, Any]) -> None:
        if progress_id is not None:
            update_progress_artifact(progress_id, 100.0 * row["step"] / total)

    code = follow(job, out / "metrics.jsonl", on_line=on_line, on_row=on_row, timeout_s=timeout_s)
    if code != 0:
        raise RuntimeError(f"trainer job ({job.kind}{' ' + job.job_id if job.job_id else ''}) failed with exit code "
                           f"{code}: {failure_line(job.log)} (log: {job.log})")
    summary = json.loads((out / SUMMARY_FILE).read_text())
    return {**summary, "log": str(job.log), "job_id": job.job_id}


run_train_job_task = task(run_train_job, name="grpo-train-job", task_run_name="grpo-train-job", cache_policy=NO_CACHE,
                          retries=0)
