"""The datagen flow: items -> generate -> score -> group -> shard, one named flow (and deployment) per environment.

    python environments/intern_bootcamp.py process --env.group_size 8 --openai.base_url http://127.0.0.1:30000
    prefect deployment run intern-bootcamp-datagen/intern-bootcamp-datagen

Work is cut into chunks of `datagen.chunk_items` items; chunk k is items
[k*c, (k+1)*c) and is committed as shard (run, producer, k). A rerun with the
same run id skips committed chunks and redoes the rest, so a `kill -9` loses
at most the chunks in flight and never duplicates a group. Chunks run on the
thread pool by default, or on a Dask LocalCluster / SLURM cluster chosen by
`datagen.task_runner` (or a block named in `datagen.task_runner_block`), with
no code change. In `serve` mode the flow pauses before each chunk while the
batching service's queue plus its own chunks in flight (or committed but not
yet indexed by the API) hold `max_batches_offpolicy` batches or more.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from factory.config import deployment_sections
from factory.datagen.config import (ENVIRONMENTS, DatagenSettings, JobConfig, ServeSettings,  # noqa: F401 (re-exported)
                                    build_job_config, job_config_model)
from factory.datagen.endpoints import choose_endpoints
from factory.datagen.ops import RunStopped, close_current
from factory.datagen.run import DatagenRun
from factory.datagen.runtime import check_importable_by_workers, make_task_runner
from factory.datagen.store import DEFAULT_RUN_FILES_DIR
from factory.flow_context import in_flow_run, tasks_on
from factory.preflight import PreflightError, preflight
from factory.run_logging import outcome_warning, project_logs_to_run
from factory.run_outcome import final_result, pipeline_failed_here, raise_if_target_missed
from factory.slurm_cluster import ClusterFault
from flows import datagen_cli
from tasks.rollout import rollout_task
from tasks.scoring_pool import ScorerPool
from tasks.shards import write_shard_retrying


@flow(name="datagen-pipeline", log_prints=False, on_failure=[close_current], on_crashed=[close_current])
def datagen_pipeline(ref: str, config: dict[str, Any]) -> dict[str, Any]:
    """Run the chunks of one job that are not committed yet; return the summary."""
    logger = get_run_logger()
    run = DatagenRun.open(ref, config, logger, write_shard=functools.partial(write_shard_retrying, logger=logger))
    cfg, d = run.cfg, run.cfg.datagen
    if run.score_mode == "process" and d.task_runner == "thread" and not d.task_runner_block:
        # Start the scorer processes now, while the first chunk is generating.
        threading.Thread(target=ScorerPool.get, args=(d.score_workers,), daemon=True).start()
    # Plan commits the chunks the in-flight window holds back and waits out backpressure; None: done or stopping.
    while (chunks := run.plan_next()) is not None:
        # generate -> score -> group, chunk by chunk, in one task run on one worker (as many chunks as make
        # datagen.min_task_s of work: a task run costs the flow ~17 ms)
        grouped = rollout_task.submit(
            run.spec, run.env_name, [(planned.chunk, planned.indices, planned.plan) for planned in chunks], cfg.openai,
            generate=dict(tokenizer_name=cfg.env.tokenizer_name, api=d.sampling_api, max_in_flight=d.max_in_flight),
            score=dict(timeout_s=d.score_timeout_s, workers=d.score_workers, mode=run.score_mode),
            group=run.group_options)
        run.in_flight(chunks, grouped)  # committed in order, one shard per chunk, in this process
    run.commit_remaining()  # after a stop signal: only the chunks that finish within the grace period
    return run.outcome()


def run_datagen(ref: str, *, env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                config_path: str | None = None, cli_args: list[str] | None = None) -> dict[str, Any]:
    """Resolve the config and run the pipeline on the configured task runner.

    Inside a flow run (a deployment's run, or the env's named flow called from Python) the pipeline runs in that
    run, not as a subflow; from the CLI the pipeline flow is the top-level run.
    """
    # A deployment's sections are defaults: a run's `--params '{"env": {...}}'` changes only the keys it names.
    values = deployment_sections(env=env, openai=openai, datagen=datagen, serve=serve)
    try:  # configuration faults: failed at once, never retried
        cfg = build_job_config(ref, config_path=config_path, values=values, cli_args=cli_args)
        choose_endpoints(cfg)  # before preflight, which checks the chosen endpoints
        if "://" not in cfg.datagen.store_root:  # './data' is where the flow runs, also for workers in other dirs
            cfg.datagen.store_root = str(Path(cfg.datagen.store_root).absolute())
        else:  # an s3:// store: its run files stay in a local directory, also where the flow runs
            cfg.datagen.run_files_dir = str(Path(cfg.datagen.run_files_dir or DEFAULT_RUN_FILES_DIR).absolute())
        check_importable_by_workers(cfg.datagen, __name__)
        preflight(cfg, mode="serve" if cfg.serve.api_url else "process", wait_s=cfg.datagen.preflight_wait_s)
        runner = make_task_runner(cfg.datagen)  # a SLURM block asks sbatch --test-only here
    except (PreflightError, ClusterFault, ValueError) as error:  # ValueError: ConfigError, a block not found
        from factory.run_control import fail_without_retry

        fail_without_retry(str(error))  # a wrong setting is not retried
        raise
    if in_flow_run():  # the run the user started does the work: its tasks, logs and artifacts are on it
        return run_pipeline_here(ref, cfg, runner)
    name = cfg.datagen.producer
    pipeline = datagen_pipeline.with_options(task_runner=runner, flow_run_name=f"{name}-{cfg.datagen.run_id}")
    state = pipeline(ref, cfg.model_dump(mode="json"), return_state=True)
    if state.is_cancelled():
        message = state.message or "cancelled"
        raise RunStopped(message, 130 if "SIGINT" in message else 143)
    summary = final_result(state)  # a missed target or dead model servers: Failed, not retried
    if warning := outcome_warning(summary):
        logging.getLogger(__name__).warning(warning)
    return summary


def run_pipeline_here(ref: str, cfg: JobConfig, runner: Any) -> Any:
    """The pipeline's body in the current flow run on `runner`; the project's warnings go to the run's log."""
    logger = get_run_logger()
    with project_logs_to_run(logger), tasks_on(runner):
        try:
            result = datagen_pipeline.fn(ref, cfg.model_dump(mode="json"))
        except BaseException as error:
            close_current()  # what the pipeline flow's on_failure/on_crashed hooks do as a subflow
            pipeline_failed_here(error)  # dead model servers: Failed without retries
            raise
    if not isinstance(result, dict):  # a State: Cancelled after SIGTERM/SIGINT, or Failed for a missed target
        raise_if_target_missed(result)
        return result  # the run ends Cancelled, without retries
    if warning := outcome_warning(result):
        logger.warning(warning)
    return result


@flow(name="intern-bootcamp-datagen", retries=2, retry_delay_seconds=30)
def intern_bootcamp_datagen(env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                            datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                            config_path: str | None = None) -> dict[str, Any]:
    """InternBootcamp rollouts into the shard store (sections as in deployments/intern_bootcamp.yaml)."""
    return run_datagen(ENVIRONMENTS["intern_bootcamp"], env=env, openai=openai, datagen=datagen, serve=serve,
                       config_path=config_path)


@flow(name="gsm8k-datagen", retries=2, retry_delay_seconds=30)
def gsm8k_datagen(env: dict[str, Any] | None = None, openai: dict[str, Any] | None = None,
                  datagen: dict[str, Any] | None = None, serve: dict[str, Any] | None = None,
                  config_path: str | None = None) -> dict[str, Any]:
    """GSM8K rollouts into the shard store (sections as in deployments/gsm8k.yaml)."""
    return run_datagen(ENVIRONMENTS["gsm8k"], env=env, openai=openai, datagen=datagen, serve=serve,
                       config_path=config_path)


def cli(ref: str, argv: list[str] | None = None) -> int:
    """`python environments/<env>.py {process,evaluate,serve} --config X --env.group_size 8 ...`."""
    from factory.cli_errors import run_cli
    from factory.config import prog_name

    return run_cli(prog_name(), lambda args: datagen_cli.main(ref, args, run=run_datagen), argv)
