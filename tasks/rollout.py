"""Chunks' rollouts: generate -> score -> group per chunk, consecutive chunks in one Prefect task run.

The three steps are the plain functions of tasks/generate.py, tasks/score.py and tasks/group.py, called in
order on the worker that generated the chunk. They used to be three task runs per chunk (four with the shard
commit): each task run costs the flow ~8-10 ms of Prefect engine CPU (90-160 ms through prefect-dask) and the
Prefect server ~57 ms of CPU, which on an 8-item chunk was a third of the flow's CPU and half a core of the local
server during the RL loop (bench/RESULTS.md, issues 25 and 33). One run per chunk also keeps a chunk's rollouts
on the worker that made them until they are grouped. A task run still costs the flow ~17 ms of CPU, several
times a 100-item chunk's work against a fast server, so one run covers as many chunks as make `datagen.min_task_s`
of work (factory/datagen/run.py); each chunk is still committed as its own shard.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from environments.base import EnvSpec
from factory.inference.client import InferenceConfig
from factory.inference.health import EndpointsDown
from factory.run_logging import logs_to_task_run
from tasks.generate import generate_chunk
from tasks.group import GroupedChunk, group_generated
from tasks.score import score_generated


ROLLOUT_TASK = "rollout"


class QuietCompletedRollouts(logging.Filter):
    """Drops Prefect's "Finished in state Completed()" record of rollout task runs (any other end is kept).

    The flow logs one progress line per committed chunk already, and the task run's state is on the run in the
    UI; that second record per chunk cost the flow ~0.5 ms (console and API log shipping) for nothing new."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (getattr(record, "task_name", None) == ROLLOUT_TASK and record.levelno == logging.INFO
                    and isinstance(record.msg, str) and record.msg.startswith("Finished in state Completed("))


def quiet_completed_rollouts() -> None:
    """Install `QuietCompletedRollouts` on Prefect's task run logger of this process (once)."""
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, QuietCompletedRollouts) for f in logger.filters):
        logger.addFilter(QuietCompletedRollouts())


def rollout_chunk(spec: EnvSpec, env: str, chunk: int, indices: Sequence[int], openai: InferenceConfig, *,
                  generate: dict[str, Any], score: dict[str, Any], group: dict[str, Any]) -> GroupedChunk:
    """The groups of chunk `chunk` (items at `indices`): keyword dicts are each step's options."""
    generated = generate_chunk(spec, indices, openai, **generate)
    scored = score_generated(spec, generated, **score)
    return group_generated(env, scored, **group)


def rollout_chunks(spec: EnvSpec, env: str, chunks: Sequence[tuple[int, Sequence[int], dict[str, Any] | None]],
                   openai: InferenceConfig, *, generate: dict[str, Any], score: dict[str, Any],
                   group: dict[str, Any]) -> list[GroupedChunk]:
    """`rollout_chunk` for each (chunk, indices, curriculum plan or None) in order: one grouped chunk per chunk."""
    quiet_completed_rollouts()  # in the process the task run runs in (a Dask or SLURM worker's too)
    return [rollout_chunk(spec, env, chunk, indices, openai, generate={**generate, "plan": plan}, score=score,
                          group=group)
            for chunk, indices, plan in chunks]


def rollout_run_name(parameters: dict[str, Any]) -> str:
    """rollout-<env>-<first chunk>-<last chunk>."""
    chunks = parameters["chunks"]
    return f"{ROLLOUT_TASK}-{parameters['env']}-{chunks[0][0]}-{chunks[-1][0]}"


def retry_unless_endpoints_down(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition: a task run (all its chunks) is retried, unless every endpoint has been down for
    openai.down_after_s."""
    return not isinstance(getattr(state, "data", None), EndpointsDown)


rollout_task = task(
    logs_to_task_run(rollout_chunks), name=ROLLOUT_TASK, task_run_name=rollout_run_name, retries=2,
    retry_delay_seconds=[5, 30], cache_policy=NO_CACHE, retry_condition_fn=retry_unless_endpoints_down,
)
