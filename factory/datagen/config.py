"""A datagen job's settings: the env's own config plus the `openai`, `datagen` and `serve` sections.

Defaults < YAML < flow parameters < CLI (`build_job_config`); the flow, the
env scripts' CLI and tests all build the config here, without Prefect.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, create_model

from environments.base import EnvConfig, EnvSpec
from factory.config import FactoryConfig, build_config
from factory.curriculum import CurriculumSettings
from factory.inference.client import InferenceConfig

SamplingApi = Literal["auto", "generate", "chat"]  # as tasks.generate.SamplingApi

ENVIRONMENTS = {
    "intern_bootcamp": "environments.intern_bootcamp:InternBootcampEnv",
    "gsm8k": "environments.gsm8k:GSM8KEnv",
}
"""Environment name -> import path; each has a `<name>-datagen` flow below."""


class DatagenSettings(FactoryConfig):
    """The `datagen.` section: where groups go and how the work is cut and executed."""

    run_id: str | None = Field(None, description="Run to write (and resume); default: the environment's name.")
    store_root: str = Field("./data", description="Shard store root: a local or shared directory, or an object store "
                            "URL s3://bucket/prefix (credentials and AWS_ENDPOINT_URL from the environment).")
    run_files_dir: str | None = Field(None, description="With an s3:// store_root: the local directory of the run's "
                                      "own files (config, per-chunk stats, curriculum state, summary, owner lock), "
                                      "default ./run-files; keep it for a resume. Unused for a local store_root.")
    producer: str | None = Field(None, description="Producer name in shard names; default: the environment's name.")
    chunk_items: int = Field(100, ge=1, description="Items per chunk: a chunk is one shard (rollouts saved every N items).")
    chunks_in_flight: int = Field(2, ge=1, description="Rollout task runs in the pipeline at once (generation "
                                  "overlaps committing); each covers one or more chunks (min_task_s).")
    min_task_s: float = Field(1.0, ge=0, description="A rollout task run covers consecutive chunks until their "
                              "expected time (this session's measured seconds per chunk) reaches this, so Prefect's "
                              "~10-20 ms per task run stays small; each chunk is still its own shard. 0: one chunk "
                              "per task run. The first task runs are one chunk each, until a chunk is measured.")
    max_task_chunks: int = Field(32, ge=1, description="Most chunks one rollout task run covers (see min_task_s).")
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
