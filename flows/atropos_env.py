"""`atropos-env`: an unchanged Atropos env script, in `serve` mode, posting to the factory's run-api.

    python -m flows.atropos_env --env.script my_env.py --env.python ~/.venv-atropos/bin/python \\
        --env.api_url http://127.0.0.1:8000 --env.inference_url http://127.0.0.1:30000/v1 --env.target_groups 100 \\
        --env.args '[--env.group_size, 8]'

The env runs with the python of its own venv (factory/atropos_env.py); its groups are committed to the store by
run-api before they are acknowledged. The flow shows the groups ingested as a progress artifact, restarts the
env when its process dies (task retries, bounded by `env.max_restarts`), and stops at `env.target_groups` or
`env.max_runtime_s`. With `task_runner_block` (e.g. `factory-slurm-cluster/datagen-nodes`) the env process runs
inside a SLURM job of that cluster block, as datagen chunks do.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from factory.atropos_env import (AtroposEnvConfig, AtroposEnvJob, EnvProgress, ensure_trainer, ingested_groups,
                                 supervise_env)
from factory.config import build_config, config_help, deployment_sections, parse_cli_overrides, split_config_path, wants_help
from factory.preflight import preflight_atropos_env


def _percent(progress: EnvProgress, config: AtroposEnvConfig) -> float:
    if config.target_groups:
        return min(100.0, 100.0 * progress.groups / config.target_groups)
    if config.max_runtime_s:
        return min(100.0, 100.0 * progress.seconds / config.max_runtime_s)
    return 0.0


@task(name="atropos-env-process", retry_delay_seconds=2)
def supervise_env_task(config: AtroposEnvConfig, baseline: int, deadline: float | None,
                       artifact_id: Any | None) -> dict[str, Any]:
    """One life of the env process; raising EnvProcessDied makes Prefect retry (start it again)."""
    from prefect.runtime import task_run

    logger = get_run_logger()
    last = [-1]

    def report(progress: EnvProgress) -> None:
        if progress.groups == last[0]:
            return
        last[0] = progress.groups
        logger.info("%d groups ingested from %s (%.0fs)", progress.groups, config.env_name, progress.seconds)
        if artifact_id is not None:
            update_progress_artifact(artifact_id, _percent(progress, config),
                                     description=f"{progress.groups} groups ingested from {config.env_name}")

    progress = supervise_env(config, baseline=baseline, deadline=deadline, restarts=task_run.run_count - 1,
                             on_progress=report)
    return vars(progress)


@flow(name="atropos-env-placed", log_prints=False)
def _placed(config: AtroposEnvConfig, baseline: int, deadline: float | None, artifact_id: Any | None) -> dict[str, Any]:
    """The env process as a task of this subflow, whose task runner (a cluster block's) decides where it runs."""
    return supervise_env_task.with_options(retries=config.max_restarts).submit(
        config, baseline, deadline, artifact_id).result()


@flow(name="atropos-env", log_prints=False)
def atropos_env_flow(env: dict[str, Any] | None = None, config_path: str | None = None,
                     task_runner_block: str | None = None) -> dict[str, Any]:
    """Run the env until its target groups, its runtime limit or its own end; returns the groups ingested."""
    logger = get_run_logger()
    values: dict[str, Any] = {"env": deployment_sections(env=env).get("env", {})}
    if task_runner_block is not None:
        values["task_runner_block"] = task_runner_block
    job = build_config(AtroposEnvJob, yaml_path=config_path, values=values)
    config = job.env
    # script, venv, run-api, inference server: a missing one is one line now, not a retried process death
    preflight_atropos_env(config, local=not job.task_runner_block)
    ensure_trainer(config)
    baseline = ingested_groups(config.api_url, config.env_name)
    deadline = time.time() + config.max_runtime_s if config.max_runtime_s else None
    artifact_id = create_progress_artifact(0.0, key="atropos-env-progress",
                                           description=f"groups ingested from {config.env_name}")
    logger.info("Atropos env %s -> %s (%d groups of %s already in the store)", config.script, config.api_url,
                baseline, config.env_name)
    if job.task_runner_block:
        from flows.datagen_runtime import make_task_runner

        runner = make_task_runner(SimpleNamespace(task_runner_block=job.task_runner_block, run_id=config.env_name))
        result = _placed.with_options(task_runner=runner)(config, baseline, deadline, artifact_id)
    else:
        result = supervise_env_task.with_options(retries=config.max_restarts)(config, baseline, deadline, artifact_id)
    result["groups"] = ingested_groups(config.api_url, config.env_name) - baseline
    done = 100.0 if result["stopped_by"] != "deadline" or not config.target_groups else _percent(
        EnvProgress(groups=result["groups"], seconds=result["seconds"]), config)
    update_progress_artifact(artifact_id, done, description=f"{result['groups']} groups ingested from "
                                                             f"{config.env_name} (stopped by {result['stopped_by']})")
    create_markdown_artifact(
        key="atropos-env-summary",
        markdown=(f"**{config.env_name}** ({config.script}): {result['groups']} groups ingested into run-api's "
                  f"store in {result['seconds']:.0f}s, {result['restarts']} restarts, stopped by "
                  f"{result['stopped_by']}."),
        description="Atropos env run",
    )
    logger.info("%d groups ingested; stopped by %s", result["groups"], result["stopped_by"])
    return result


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if wants_help(args):
        print(config_help(AtroposEnvJob, prog="python -m flows.atropos_env", description=__doc__.strip(),
                          extra_options=[("--config PATH", "YAML file whose keys the dotted options override.")]))
        return 0
    config_path, rest = split_config_path(args)
    overrides = parse_cli_overrides(rest)
    atropos_env_flow(env=overrides.get("env"), config_path=config_path,
                     task_runner_block=overrides.get("task_runner_block"))
    return 0


if __name__ == "__main__":
    from factory.cli_errors import run_cli

    raise SystemExit(run_cli("python -m flows.atropos_env", main))
