"""`train-grpo`: the GRPO trainer flow. Pulls batches (batching API or a run's shards), updates the policy, pushes
each checkpoint to the inference endpoints so the groups made afterwards carry the new policy version.

    python -m flows.train --config deployments/train_grpo.yaml --source.api_url http://127.0.0.1:8000 \
        --push.endpoints '[http://127.0.0.1:30000]' --train.total_steps 60
    python -m flows.train --source.kind store --source.runs '[intern-bootcamp]' --train.output_dir ckpt/offline

Running it again with the same `train.output_dir` resumes from the newest checkpoint (and re-registers with
the API at that step). Sections: `train.` (model, loss, optim, checkpoints), `source.`, `push.` —
factory/train/config.py documents every key.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, get_run_logger

from factory.config import build_config, deployment_sections, split_config_path
from factory.preflight import check_model_ref, preflight_trainer
from factory.train.config import TrainJobConfig
from tasks.grpo import publish_train_summary_task, train_grpo_task


def build_train_config(*, config_path: str | None = None, values: dict[str, Any] | None = None,
                       cli_args: list[str] | None = None) -> TrainJobConfig:
    """Defaults < YAML < flow parameters < CLI, validated."""
    return build_config(TrainJobConfig, yaml_path=config_path, values=values or {}, cli_args=cli_args or [])


@flow(name="train-grpo", log_prints=False)
def train_grpo(train: dict[str, Any] | None = None, source: dict[str, Any] | None = None,
               push: dict[str, Any] | None = None, config_path: str | None = None) -> dict[str, Any]:
    """Train with GRPO until `train.total_steps` or `train.max_runtime_s`; returns the summary (also artifacts)."""
    logger = get_run_logger()
    values = deployment_sections(train=train, source=source, push=push)  # a run's keys merge into the deployment's
    cfg = build_train_config(config_path=config_path, values=values)
    preflight_trainer(cfg)  # no run-api or policy server: one line in seconds, not a wait of source.max_wait_s
    where = cfg.source.api_url if cfg.source.kind == "api" else f"store {cfg.source.store_root} runs {cfg.source.runs}"
    logger.info("GRPO on %s from %s, %d steps of %d sequences -> %s; pushing to %s", cfg.train.model_path, where,
                cfg.train.total_steps, cfg.train.batch_size, cfg.train.output_dir, cfg.push.endpoints or "no endpoint")
    summary = train_grpo_task(cfg)
    logger.info("stopped at step %d (%s); checkpoint %s; curve %s", summary["step"], summary["stop_reason"],
                summary["checkpoint"], summary["curve"])
    return publish_train_summary_task(summary)


def main(argv: list[str] | None = None) -> None:
    """One process: the `train-grpo` flow. Under torchrun (`torchrun --nproc-per-node N -m flows.train ...`): every
    rank runs the sharded trainer (factory/train/dist_loop.py) without a flow; `grpo-train` (flows/grpo_train.py)
    is the Prefect flow that launches such a job locally or on SLURM and follows it."""
    args = list(sys.argv[1:] if argv is None else argv)
    from factory.train.world import under_torchrun

    if under_torchrun():
        from factory.train.dist_loop import main_distributed

        sys.exit(main_distributed(args))
    yaml_path, overrides = split_config_path(args)
    cfg = build_train_config(config_path=yaml_path, cli_args=overrides)
    check_model_ref("train.model_path", cfg.train.model_path, needs=("config.json",))  # refused before a flow run starts
    summary = train_grpo(train=cfg.train.model_dump(mode="json"), source=cfg.source.model_dump(mode="json"),
                         push=cfg.push.model_dump(mode="json"))
    print(f"step {summary['step']} ({summary['stop_reason']}): checkpoint {summary['checkpoint']}, "
          f"metrics {summary['metrics']}, curve {summary['curve']}")


if __name__ == "__main__":
    from factory.cli_errors import run_cli

    raise SystemExit(run_cli("python -m flows.train", main))
