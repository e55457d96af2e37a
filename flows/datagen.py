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

import json
import logging
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact, update_progress_artifact
from pydantic import Field, create_model

from environments.base import EnvConfig, EnvSpec, load_env
from factory.config import FactoryConfig, build_config, deployment_sections, to_yaml
from factory.curriculum import CurriculumSettings
from factory.flow_context import in_flow_run, tasks_on
from factory.inference.client import InferenceConfig
from factory.preflight import PreflightError, preflight
from factory.run_logging import outcome_warning, project_logs_to_run
from factory.sampling import DynamicSampling, make_curriculum
from factory.slurm_cluster import ClusterFault
from factory.store import ShardStore
from flows.datagen_ops import RunOps, RunStopped, close_current
from flows.datagen_runtime import Backpressure, check_importable_by_workers, make_task_runner, use_endpoints_block
from tasks.generate import SamplingApi, generate_task
from tasks.group import DROP_REASONS, group_task
from tasks.score import score_task
from tasks.scoring_pool import ScorerPool
from tasks.shards import write_shard_task

ENVIRONMENTS = {
    "intern_bootcamp": "environments.intern_bootcamp:InternBootcampEnv",
    "gsm8k": "environments.gsm8k:GSM8KEnv",
}
"""Environment name -> import path; each has a `<name>-datagen` flow below."""


class DatagenSettings(FactoryConfig):
    """The `datagen.` section: where groups go and how the work is cut and executed."""

    run_id: str | None = Field(None, description="Run to write (and resume); default: the environment's name.")
    store_root: str = Field("./data", description="Shard store root directory.")
    producer: str | None = Field(None, description="Producer name in shard names; default: the environment's name.")
    chunk_items: int = Field(100, ge=1, description="Items per chunk: a chunk is one shard (rollouts saved every N items).")
    chunks_in_flight: int = Field(2, ge=1, description="Chunks in the pipeline at once (generation overlaps scoring).")
    max_in_flight: int = Field(64, ge=1, description="Items sampled concurrently within a chunk.")
    sampling_api: SamplingApi = Field("auto", description="generate (token in/out), chat, or auto (by openai.server_type).")
    score_mode: Literal["auto", "process", "inline"] = Field(
        "auto", description="Score in scorer processes (per-item timeout) or inline; auto: the env's `scoring`.")
    score_workers: int = Field(2, ge=1, description="Scorer processes per flow process.")
    score_timeout_s: float = Field(10.0, gt=0, description="Seconds one item's completions may take to score.")
    task_runner: Literal["thread", "dask", "slurm"] = Field("thread", description="Where chunk tasks run.")
    task_runner_block: str | None = Field(None, description="Block slug 'type/name' whose task_runner() overrides task_runner.")
    thread_workers: int = Field(8, ge=1, description="Threads of the thread-pool runner.")
    dask_workers: int = Field(2, ge=1, description="Worker processes of the Dask LocalCluster.")
    dask_threads_per_worker: int = Field(4, ge=1, description="Threads per Dask worker.")
    slurm: dict[str, Any] = Field(default_factory=dict, description="dask_jobqueue.SLURMCluster keyword arguments.")
    slurm_jobs: int = Field(1, ge=1, description="Most SLURM jobs the cluster adapts up to.")
    endpoints_block: str | None = Field(None, description="InferenceEndpointsBlock name (e.g. 'sglang-endpoints', saved "
                                        "by the sglang-on-slurm flow) whose endpoints replace openai.base_url.")
    output_dir: str | None = Field(None, description="Where process/evaluate write JSONL, HTML, metrics; default: the run dir.")
    target_groups: int | None = Field(None, ge=1, description="Draw items until this many groups are kept (exactly; "
                                      "env.total_items is then ignored); None: run env.total_items items.")
    max_items: int | None = Field(None, ge=1, description="Most items a target_groups run tries before it stops "
                                  "(default 10 x target_groups); also caps env.total_items when set.")
    curriculum: CurriculumSettings = Field(default_factory=CurriculumSettings,
                                           description="Adaptive difficulty per task family (factory/curriculum.py).")
    preflight_wait_s: float = Field(0.0, ge=0, description="Seconds preflight waits for endpoints still starting (0: fail at once).")
    shutdown_grace_s: float = Field(20.0, ge=0, description="After SIGTERM/SIGINT, seconds chunks in flight get to finish and commit (under the 30 s a Prefect worker waits before SIGKILL).")


class ServeSettings(FactoryConfig):
    """The `serve.` section: backpressure against the batching service in serve mode."""

    api_url: str | None = Field(None, description="Batching API root (e.g. http://127.0.0.1:8000); None disables backpressure.")
    max_batches_offpolicy: int = Field(3, ge=0, description="Pause while the API queue holds this many batches (0: never).")
    batch_size: int = Field(-1, description="Trainer batch size in sequences; -1 asks the API's /info.")
    poll_s: float = Field(1.0, gt=0, description="Seconds between /status polls while paused.")


class JobConfig(FactoryConfig):
    """A whole datagen job: env, inference endpoints, datagen execution, serve backpressure."""

    env: EnvConfig = Field(default_factory=EnvConfig, description="The environment's own config.")
    openai: InferenceConfig = Field(default_factory=InferenceConfig, description="Inference endpoints (Atropos's openai section).")
    datagen: DatagenSettings = Field(default_factory=DatagenSettings, description="Store, chunking and execution.")
    serve: ServeSettings = Field(default_factory=ServeSettings, description="Backpressure against the batching API.")


def job_config_model(ref: str) -> type[JobConfig]:
    """The JobConfig whose `env` section is the environment's own config class."""
    cls = EnvSpec(ref, {}).env_class()
    return create_model(
        f"{cls.__name__}Job", __base__=JobConfig,
        env=(cls.config_cls, Field(default_factory=cls.config_cls, description=f"{cls.__name__} config.")),
    )


def build_job_config(ref: str, *, config_path: str | None = None, values: dict[str, Any] | None = None,
                     cli_args: list[str] | None = None) -> JobConfig:
    """Defaults < YAML < flow parameters < CLI, validated; run id and producer default to the env name."""
    cfg = build_config(job_config_model(ref), yaml_path=config_path, values=values or {}, cli_args=cli_args or [])
    name = EnvSpec(ref, {}).env_class().name
    if cfg.datagen.run_id is None:
        cfg.datagen.run_id = name.replace("_", "-")
    if cfg.datagen.producer is None:
        cfg.datagen.producer = name.replace("_", "-")
    if cfg.env.tokenizer_name is None and cfg.openai.model_name != "default":
        cfg.env.tokenizer_name = cfg.openai.model_name
    return cfg


def _stats_name(producer: str, chunk: int) -> str:
    return f"stats-{producer}-{chunk:08d}.json"


def covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) intervals: wall time with at least one chunk in inference."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize(store: ShardStore, cfg: JobConfig, seconds: float, session: Counter[str],
              intervals: list[tuple[float, float]]) -> dict[str, Any]:
    """Totals over every committed chunk of this producer (this session and earlier ones)."""
    run, producer = cfg.datagen.run_id, cfg.datagen.producer
    totals: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    for record in store.committed(run).values():
        if record.producer != producer:
            continue
        path = store.run_dir(run) / _stats_name(producer, record.chunk)
        if path.is_file():
            stats = json.loads(path.read_text())
            dropped.update(stats["dropped"])
            for key in ("groups_kept", "rollouts", "completion_tokens", "scored"):
                totals[key] += stats[key]
            totals["score_sum_milli"] += round(stats["score_sum"] * 1000)
        totals["chunks"] += 1
    return {
        "run_id": run,
        "producer": producer,
        "chunks_committed": totals["chunks"],
        "groups_kept": totals["groups_kept"],
        "dropped": {reason: dropped.get(reason, 0) for reason in DROP_REASONS},
        "rollouts": totals["rollouts"],
        "mean_score": (totals["score_sum_milli"] / 1000 / totals["scored"]) if totals["scored"] else None,
        "session_seconds": round(seconds, 3),
        "session_chunks": session["chunks"],
        "session_rollouts_per_s": round(session["rollouts"] / seconds, 2) if seconds else None,
        "session_tokens_per_s": round(session["completion_tokens"] / seconds, 2) if seconds else None,
        "session_groups_per_s": round(session["groups_kept"] / seconds, 2) if seconds else None,
        "inference_share": round(covered(intervals) / seconds, 3) if seconds else None,
        "paused_s": round(session["paused_ms"] / 1000, 2),
        "store": str(store.run_dir(run)),
    }


@flow(name="datagen-pipeline", log_prints=False, on_failure=[close_current], on_crashed=[close_current])
def datagen_pipeline(ref: str, config: dict[str, Any]) -> dict[str, Any]:
    """Run the chunks of one job that are not committed yet; return the summary."""
    logger = get_run_logger()
    cfg = job_config_model(ref).model_validate(config)
    d = cfg.datagen
    store = ShardStore(d.store_root)
    ops = RunOps.start(store, cfg, logger)
    store.write_run_file(d.run_id, f"config-{d.producer}.yaml", to_yaml(cfg))
    spec = EnvSpec(ref, cfg.env.model_dump(mode="json"))
    env_name = spec.env_class().name
    env = load_env(spec, setup=False)
    curriculum = make_curriculum(d.curriculum, env, start_level=min(getattr(cfg.env, "difficulties", [1])))
    sampler = DynamicSampling(store, run_id=d.run_id, producer=d.producer, chunk_items=d.chunk_items,
                              total_items=cfg.env.total_items, target_groups=d.target_groups, max_items=d.max_items,
                              chunks_in_flight=d.chunks_in_flight, curriculum=curriculum, solved=env.solved)
    if d.target_groups is None:
        logger.info("%s: %d of %d chunks to do in run %r (store %s)", env_name, sampler.todo_chunks(),
                    sampler.n_chunks, d.run_id, d.store_root)
    else:
        logger.info("%s: %d of target %d groups committed in run %r (%d chunks); drawing up to %d items",
                    env_name, sampler.committed_groups, d.target_groups, d.run_id, sampler.restored_chunks,
                    sampler.max_items)
    progress_id = ops.progress_artifact(sampler.progress(), key=f"{d.run_id}-progress".lower().replace("_", "-"),
                                        description=f"{env_name} datagen: chunks of {d.chunk_items} items committed to "
                                        f"{d.run_id} (store {store.run_dir(d.run_id).absolute()})")
    ops.track(d.producer, total_chunks=sampler.n_chunks, done_before=len(sampler.committed_chunks))
    curriculum_key = f"{d.run_id}-curriculum".lower().replace("_", "-")
    score_mode = spec.env_class().scoring if d.score_mode == "auto" else d.score_mode
    if score_mode == "process" and d.task_runner == "thread" and not d.task_runner_block:
        # Start the scorer processes now, while the first chunk is generating.
        threading.Thread(target=ScorerPool.get, args=(d.score_workers,), daemon=True).start()
    backpressure = Backpressure(cfg.serve, cfg.env.group_size) if cfg.serve.api_url else None
    generation_params = cfg.env.model_dump(include={"temperature", "top_p", "max_tokens"})
    session: Counter[str] = Counter()
    started = time.perf_counter()
    in_flight: deque[tuple[int, Any, int]] = deque()
    intervals: list[tuple[float, float]] = []

    def finish(chunk: int, grouped_future: Any, items: int) -> None:
        grouped = ops.result(grouped_future)
        generate_s = grouped.generate_s
        intervals.append((grouped.generate_started_at, grouped.generate_started_at + generate_s))
        if not sampler.admit(chunk, grouped):  # target reached by an earlier chunk: this one is not committed
            logger.info("chunk %d: thrown away uncommitted, the target of %s groups is reached", chunk, d.target_groups)
            return
        stats = {**grouped.stats(), "chunk": chunk, **sampler.chunk_stats(chunk, grouped),
                 "flow_run_id": ops.own_run}  # view-run links to the flow run
        store.write_run_file(d.run_id, _stats_name(d.producer, chunk), json.dumps(stats))
        # The chunk object, not quote(list): Dask rebuilds quote (a tuple subclass) around its own args, and the
        # writer got nested tuples; a plain iterable object is walked by neither Prefect nor Dask.
        write_shard_task.submit(d.store_root, d.run_id, d.producer, chunk, grouped).result()
        moves = sampler.committed(chunk, stats)
        if backpressure is not None:
            backpressure.committed += len(grouped.groups)
        session.update({"chunks": 1, "rollouts": grouped.rollouts, "groups_kept": len(grouped.groups),
                        "completion_tokens": grouped.completion_tokens, "generate_ms": round(generate_s * 1000)})
        update_progress_artifact(progress_id, sampler.progress())
        logger.info("chunk %d: kept %d groups, dropped %s", chunk, len(grouped.groups), dict(grouped.dropped))
        if curriculum is not None:
            for move in moves:
                logger.info("curriculum: %s level %d -> %d (recent pass rate %.2f)", move["family"], move["from"],
                            move["to"], move["pass_rate"])
            create_table_artifact(table=curriculum.table(), key=curriculum_key,
                                  description=f"{env_name} curriculum after chunk {chunk} of run {d.run_id}")
        ops.chunk_committed(groups_kept=len(grouped.groups), rollouts=grouped.rollouts)

    while not ops.stopping:
        while in_flight and not ops.stopping and (len(in_flight) >= d.chunks_in_flight
                                                  or sampler.enough_in_flight(sum(items for _, _, items in in_flight))):
            finish(*in_flight.popleft())
        if ops.stopping:
            break
        chunk = sampler.next_chunk()
        if chunk is None:
            break
        indices = sampler.indices(chunk)
        if backpressure is not None:
            # Chunks in flight count against the limit; commit them before pausing so the trainer can have them.
            if in_flight and backpressure.would_wait(sum(items for _, _, items in in_flight)):
                while in_flight:
                    finish(*in_flight.popleft())
            session["paused_ms"] += round(backpressure.wait(logger) * 1000)
        generated = generate_task.submit(spec, indices, cfg.openai, tokenizer_name=cfg.env.tokenizer_name,
                                         api=d.sampling_api, max_in_flight=d.max_in_flight,
                                         plan=sampler.plan_for(chunk))
        scored = score_task.submit(spec, generated, timeout_s=d.score_timeout_s, workers=d.score_workers,
                                   mode=score_mode)
        grouped = group_task.submit(env_name, scored, group_size=cfg.env.group_size,
                                    max_token_length=cfg.env.max_token_length,
                                    ensure_scores_are_not_same=cfg.env.ensure_scores_are_not_same,
                                    run_id=d.run_id, seed=cfg.env.seed, generation_params=generation_params)
        ops.submitted(grouped, generated, scored)
        in_flight.append((chunk, grouped, len(indices)))
    while in_flight:
        if ops.stopping and not ops.finishes_in_grace(in_flight[0][1]):
            break  # the rest is abandoned uncommitted; a rerun redoes it
        finish(*in_flight.popleft())

    summary = {**summarize(store, cfg, time.perf_counter() - started, session, intervals), **sampler.summary()}
    if (message := sampler.stop_message()) is not None:
        logger.warning(message)
        summary["stop_message"] = message
    store.write_run_file(d.run_id, f"stats-{d.producer}.json", json.dumps(summary, indent=2))
    rows = [{"metric": k, "value": json.dumps(v) if isinstance(v, dict) else v} for k, v in summary.items()]
    ops.summary_artifact(rows, key=f"{d.run_id}-summary".lower().replace("_", "-"),
                         description=f"{env_name} datagen summary for run {d.run_id}", store_dir=summary["store"])
    logger.info("summary: %s", json.dumps(summary))
    if ops.stopping:
        return ops.stopped(summary, abandoned=[chunk for chunk, _, _ in in_flight])
    ops.finished()
    return summary


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
        use_endpoints_block(cfg)  # before preflight, which checks the block's endpoints
        if "://" not in cfg.datagen.store_root:  # './data' is where the flow runs, also for workers in other dirs
            cfg.datagen.store_root = str(Path(cfg.datagen.store_root).absolute())
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
    summary = state.result()
    if warning := outcome_warning(summary):
        logging.getLogger(__name__).warning(warning)
    return summary


def run_pipeline_here(ref: str, cfg: JobConfig, runner: Any) -> Any:
    """The pipeline's body in the current flow run on `runner`; the project's warnings go to the run's log."""
    logger = get_run_logger()
    with project_logs_to_run(logger), tasks_on(runner):
        try:
            result = datagen_pipeline.fn(ref, cfg.model_dump(mode="json"))
        except BaseException:
            close_current()  # what the pipeline flow's on_failure/on_crashed hooks do as a subflow
            raise
    if isinstance(result, dict) and (warning := outcome_warning(result)):
        logger.warning(warning)
    return result  # a Cancelled state after SIGTERM/SIGINT: the run ends Cancelled, without retries


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
    from flows.datagen_cli import main

    return run_cli(prog_name(), lambda args: main(ref, args), argv)
