"""One datagen run's bookkeeping, so the flow body is only plan -> generate -> score -> group -> commit.

`ChunksInFlight` is the window of chunks submitted and not yet committed;
`ChunkCommitter` is what committing one chunk means (admission against the
target, the chunk's stats file, the shard, the sampler's and curriculum's
state, folding the stats files into segments, session counters). Both are plain and tested without Prefect.
`DatagenRun` ties them to one flow run: run ownership and stop signals
(`RunOps`), backpressure, progress line and artifacts, and the run's outcome.

Extension points: the run's endpoints are chosen in
`factory.datagen.endpoints.choose_endpoints` (before preflight); its end state
is decided in `DatagenRun.outcome` only.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from environments.base import EnvSpec, load_env
from factory.chunk_stats import Folder, Restore, chunk_stats_name
from factory.config import to_yaml
from factory.datagen.backpressure import Backpressure
from factory.datagen.config import JobConfig, job_config_model
from factory.datagen.ops import RunOps
from factory.datagen.store import open_datagen_store, run_location
from factory.datagen.summary import summarize
from factory.prefect_outage import best_effort
from factory.run_outcome import count_discarded, forget_stats, read_discarded, target_missed_message, whole_run_totals
from factory.sampling import DynamicSampling, make_curriculum
from factory.store import ShardStore

WriteShard = Callable[[str, str, str, int, Any], Any]
"""(store_root, run_id, producer, chunk, groups) -> commit record: tasks.shards.write_shard or its Prefect task."""


@dataclass(frozen=True)
class PlannedChunk:
    """A chunk about to be generated: its number, its item indices and the curriculum's plan for them (or None)."""

    chunk: int
    indices: range
    plan: dict[str, Any] | None = None


class ChunkOfTask:
    """Chunk `index` of a rollout task run that covers several chunks: that run's future, seen as one chunk's
    (`result`, `wait`, `state`), so committing and stop handling stay per chunk."""

    def __init__(self, future: Any, index: int) -> None:
        self.future, self.index = future, index

    def result(self, timeout: float | None = None) -> Any:
        return self.future.result(timeout=timeout)[self.index]

    def wait(self, timeout: float | None = None) -> None:
        self.future.wait(timeout)

    @property
    def state(self) -> Any:
        return self.future.state


class ChunksInFlight:
    """Chunks submitted and not committed yet, oldest first, each with the future (or value) of its groups.

    `limit` counts rollout task runs, each covering one or more consecutive chunks (`add_task`): the window is
    full while it holds `limit` task runs, so generating task run k+1 overlaps committing task run k."""

    def __init__(self, limit: int, sampler: DynamicSampling) -> None:
        self.limit = limit
        self.sampler = sampler
        self._chunks: deque[tuple[PlannedChunk, Any, int]] = deque()  # (chunk, future, its task run's number)
        self._chunks_left: Counter[int] = Counter()  # task run number -> its chunks not popped yet
        self._tasks = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def add(self, planned: PlannedChunk, grouped: Any) -> None:
        """One task run of one chunk whose future (or value) `grouped` is the chunk's groups."""
        self._add([(planned, grouped)])

    def add_task(self, chunks: list[PlannedChunk], grouped: Any) -> None:
        """The chunks of one task run whose future `grouped` gives their groups as a list, one per chunk."""
        self._add([(planned, ChunkOfTask(grouped, index)) for index, planned in enumerate(chunks)])

    def _add(self, chunks: list[tuple[PlannedChunk, Any]]) -> None:
        self._tasks += 1
        self._chunks.extend((planned, grouped, self._tasks) for planned, grouped in chunks)
        self._chunks_left[self._tasks] = len(chunks)

    def items(self) -> int:
        return sum(len(planned.indices) for planned, _, _ in self._chunks)

    def tasks(self) -> int:
        """Task runs in flight."""
        return len(self._chunks_left)

    def full(self) -> bool:
        """Whether the oldest chunk must be committed before another is planned: the window holds `limit` task
        runs, or the items in flight may already reach the target."""
        return bool(self._chunks) and (self.tasks() >= self.limit or self.sampler.enough_in_flight(self.items()))

    def oldest(self) -> Any:
        return self._chunks[0][1]

    def pop(self) -> tuple[PlannedChunk, Any]:
        planned, grouped, task = self._chunks.popleft()
        self._chunks_left[task] -= 1
        if not self._chunks_left[task]:
            del self._chunks_left[task]
        return planned, grouped

    def chunks(self) -> list[int]:
        return [planned.chunk for planned, _, _ in self._chunks]


def chunks_per_task(min_task_s: float, seconds_per_chunk: float | None, most: int) -> int:
    """How many consecutive chunks one rollout task run should cover: enough that their expected time reaches
    `min_task_s` (at most `most`); 1 before any chunk is measured (None) or with min_task_s 0."""
    if min_task_s <= 0 or seconds_per_chunk is None:
        return 1
    if seconds_per_chunk <= 0:
        return most
    return max(1, min(most, math.ceil(min_task_s / seconds_per_chunk)))


class ChunkCommitter:
    """Commits chunks of groups in order: admit, stats file, shard, sampler/curriculum state, session counters."""

    def __init__(self, store: ShardStore, *, root: str, run_id: str, producer: str, sampler: DynamicSampling,
                 write_shard: WriteShard, flow_run_id: str | None = None, backpressure: Backpressure | None = None,
                 folder: Folder | None = None):
        self.store, self.root, self.run_id, self.producer = store, root, run_id, producer
        self.sampler = sampler
        self.write_shard = write_shard
        self.flow_run_id = flow_run_id
        self.backpressure = backpressure
        self.folder = folder
        """Folds the producer's committed chunks' stats files into segments (factory/chunk_stats.py); None: never."""
        self.session: Counter[str] = Counter()
        """This session's committed chunks, rollouts, groups kept, completion tokens, ms generating and paused."""
        self.intervals: list[tuple[float, float]] = []
        """(start, end) of each chunk's generation: wall time with at least one chunk in inference."""

    def commit(self, chunk: int, grouped: Any) -> list[dict[str, Any]] | None:
        """Commit one chunk's groups; the curriculum moves it caused, or None when it was thrown away uncommitted
        (an earlier chunk reached the target)."""
        self.intervals.append((grouped.generate_started_at, grouped.generate_started_at + grouped.generate_s))
        if not self.sampler.admit(chunk, grouped):
            count_discarded(self.store, self.run_id, self.producer, grouped)  # its rollouts still count
            return None
        stats = {**grouped.stats(), "chunk": chunk, **self.sampler.chunk_stats(chunk, grouped),
                 "flow_run_id": self.flow_run_id}  # view-run links to the flow run
        stats_name = chunk_stats_name(self.producer, chunk)
        self.store.write_run_file(self.run_id, stats_name, json.dumps(stats))
        # The chunk object, not quote(list): Dask rebuilds quote (a tuple subclass) around its own args, and the
        # writer got nested tuples; a plain iterable object is walked by neither Prefect nor Dask.
        try:
            self.write_shard(self.root, self.run_id, self.producer, chunk, grouped)
        except BaseException:  # no stats file for an uncommitted chunk
            forget_stats(self.store, self.run_id, stats_name)
            raise
        moves = self.sampler.committed(chunk, stats)
        if self.folder is not None:
            self.folder.committed(chunk, stats)
        if self.backpressure is not None:
            self.backpressure.committed += len(grouped.groups)
        self.session.update({"chunks": 1, "rollouts": grouped.rollouts, "groups_kept": len(grouped.groups),
                             "completion_tokens": grouped.completion_tokens,
                             "generate_ms": round(grouped.generate_s * 1000)})
        return moves


class Throttle:
    """At most one report per `every_s` seconds: `due()` says whether to send one now; `held_back()` whether the
    latest was skipped (send it at the end). The first report is always due."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self._last: float | None = None
        self._held = False

    def due(self) -> bool:
        now = self.clock()
        if self._last is None or now - self._last >= self.every_s:
            self._last, self._held = now, False
            return True
        self._held = True
        return False

    def sent(self) -> None:
        """Count now as a report: the next is due `every_s` from now (a run's first progress report waits)."""
        self._last, self._held = self.clock(), False

    def held_back(self) -> bool:
        held, self._held = self._held, False
        return held


PROGRESS_ARTIFACT_EVERY_S = 5.0
"""The progress artifact is reported at most this often (each report is a Prefect API call from the flow body; the
progress log line still comes with every chunk), and once more at the end; it is created with the first report, this
long into the run (a shorter run creates it once, at its end). The curriculum table too, except that a chunk that
moves a level publishes it at once."""


def artifact_key(run_id: str, what: str) -> str:
    return f"{run_id}-{what}".lower().replace("_", "-")


class DatagenRun:
    """One flow run of the datagen pipeline: everything but the data path itself.

    The flow asks `plan_next` for chunks, submits one generate -> score -> group task run for them and hands its
    future to `in_flight`; committing happens here, oldest first, as the window fills, before a backpressure
    pause, and in `commit_remaining` at the end. `outcome` decides how the run ends.
    """

    def __init__(self, ref: str, cfg: JobConfig, logger: Any, *, write_shard: WriteShard) -> None:
        d = cfg.datagen
        self.cfg, self.logger = cfg, logger
        self.store = open_datagen_store(d.store_root, d.run_files_dir)
        self.ops = RunOps.start(self.store, cfg, logger)  # also cleans up what a stopped process left
        self.store.write_run_file(d.run_id, f"config-{d.producer}.yaml", to_yaml(cfg))
        self.spec = EnvSpec(ref, cfg.env.model_dump(mode="json"))
        env_class = self.spec.env_class()
        self.env_name = env_class.name
        self.score_mode = env_class.scoring if d.score_mode == "auto" else d.score_mode
        env = load_env(self.spec, setup=False)
        self.curriculum = make_curriculum(d.curriculum, env, start_level=min(getattr(cfg.env, "difficulties", [1])))
        chunk_stats = Restore(self.store.run_dir(d.run_id), d.producer)  # one read for the sampler and the folder
        self.sampler = DynamicSampling(self.store, run_id=d.run_id, producer=d.producer, chunk_items=d.chunk_items,
                                       total_items=cfg.env.total_items, target_groups=d.target_groups,
                                       max_items=d.max_items, chunks_in_flight=d.chunks_in_flight,
                                       curriculum=self.curriculum, solved=env.solved, chunk_stats=chunk_stats)
        folder = Folder(self.store, d.run_id, d.producer, chunk_stats, self.sampler.committed_chunks)
        self.backpressure = Backpressure(cfg.serve, cfg.env.group_size) if cfg.serve.api_url else None
        self.committer = ChunkCommitter(self.store, root=d.store_root, run_id=d.run_id, producer=d.producer,
                                        sampler=self.sampler, write_shard=write_shard, flow_run_id=self.ops.own_run,
                                        backpressure=self.backpressure, folder=folder)
        self.window = ChunksInFlight(d.chunks_in_flight, self.sampler)
        self.progress_throttle = Throttle(PROGRESS_ARTIFACT_EVERY_S)
        self.curriculum_throttle = Throttle(PROGRESS_ARTIFACT_EVERY_S)
        self.last_committed_chunk: int | None = None
        self.group_options = {
            "group_size": cfg.env.group_size, "max_token_length": cfg.env.max_token_length,
            "ensure_scores_are_not_same": cfg.env.ensure_scores_are_not_same, "run_id": d.run_id,
            "seed": cfg.env.seed, "generation_params": cfg.env.model_dump(include={"temperature", "top_p", "max_tokens"}),
        }
        self.started = time.perf_counter()
        self._announce()

    @classmethod
    def open(cls, ref: str, config: dict[str, Any], logger: Any, *, write_shard: WriteShard) -> DatagenRun:
        """Validate the job's config, claim the run and restore what earlier sessions committed."""
        return cls(ref, job_config_model(ref).model_validate(config), logger, write_shard=write_shard)

    def _announce(self) -> None:
        d, sampler = self.cfg.datagen, self.sampler
        if d.target_groups is None:
            self.logger.info("%s: %d of %d chunks to do in run %r (store %s)", self.env_name, sampler.todo_chunks(),
                             sampler.n_chunks, d.run_id, d.store_root)
        else:
            self.logger.info("%s: %d of target %d groups committed in run %r (%d chunks); drawing up to %d items",
                             self.env_name, sampler.committed_groups, d.target_groups, d.run_id,
                             sampler.restored_chunks, sampler.max_items)
        self.progress_id: Any = None  # the progress artifact: made with the first progress report (_report_progress)
        self.progress_throttle.sent()  # the first report is due PROGRESS_ARTIFACT_EVERY_S into the run, or at its end
        self.ops.track(d.producer, total_chunks=sampler.n_chunks, done_before=len(sampler.committed_chunks),
                       groups_before=sampler.committed_groups)

    def _report_progress(self) -> None:
        """The progress artifact: created with the first report, updated after (each an API round trip, so a run
        shorter than PROGRESS_ARTIFACT_EVERY_S makes one call at its end instead of create + update + final update;
        none is fatal in a Prefect outage, and one that failed is retried with the next report)."""
        from prefect.artifacts import update_progress_artifact

        if self.progress_id is not None:
            best_effort(update_progress_artifact, self.progress_id, self.sampler.progress())
            return
        d = self.cfg.datagen
        self.progress_id = best_effort(
            self.ops.progress_artifact, self.sampler.progress(), key=artifact_key(d.run_id, "progress"),
            description=f"{self.env_name} datagen: chunks of {d.chunk_items} items committed to {d.run_id} "
                        f"(store {run_location(self.store, d.run_id)})")

    @property
    def stopping(self) -> bool:
        return self.ops.stopping

    # ---- plan -------------------------------------------------------------------------------------------------

    def plan_next(self) -> list[PlannedChunk] | None:
        """The next chunks to generate in one rollout task run (consecutive, at least one), after committing what
        the window holds back and any backpressure pause; None when every chunk is planned, the target is reached,
        or a stop signal came."""
        while self.window and not self.stopping and (self.window.full()
                                                     or not self._plan_final(self.sampler.peek_chunk())):
            self._commit_oldest()
        if self.stopping:
            return None
        self.ops.check_prefect_api()  # nothing in a chunk's data path waits on the API: notice an outage here
        chunk = self.sampler.next_chunk()
        if chunk is None:
            return None
        indices = self.sampler.indices(chunk)
        if self.backpressure is not None:
            # Chunks in flight count against the limit; commit them before pausing so the trainer can have them.
            if self.window and self.backpressure.would_wait(self.window.items()):
                while self.window:
                    self._commit_oldest()
            self.committer.session["paused_ms"] += round(self.backpressure.wait(self.logger) * 1000)
        chunks = [PlannedChunk(chunk, indices, self.sampler.plan_for(chunk))]
        wanted = chunks_per_task(self.cfg.datagen.min_task_s, self.seconds_per_chunk(),
                                 self.cfg.datagen.max_task_chunks)
        while len(chunks) < wanted and self._may_add_chunk(chunks):
            chunk = self.sampler.next_chunk()
            chunks.append(PlannedChunk(chunk, self.sampler.indices(chunk), self.sampler.plan_for(chunk)))
        return chunks

    def seconds_per_chunk(self) -> float | None:
        """Mean generation seconds of the chunks committed this session; None before the first."""
        session = self.committer.session
        return session["generate_ms"] / 1000 / session["chunks"] if session["chunks"] else None

    def _may_add_chunk(self, chunks: list[PlannedChunk]) -> bool:
        """Whether the task run being planned may cover one more chunk: not when the target is expected from what
        is in flight and planned, the next chunk's curriculum plan is not final yet, the flow would pause for
        backpressure, or a stop signal came."""
        items = self.window.items() + sum(len(planned.indices) for planned in chunks)
        if self.stopping or self.sampler.enough_in_flight(items):
            return False
        upcoming = self.sampler.peek_chunk()
        if upcoming is None or not self._plan_final(upcoming):
            return False
        return self.backpressure is None or not self.backpressure.would_wait(items)

    def _plan_final(self, chunk: int | None) -> bool:
        """Whether chunk `chunk` (None: there is none) may be drawn now: with a curriculum, only once chunk - lag
        is committed (one chunk per task run: always, the window holds fewer than lag chunks)."""
        return chunk is None or self.sampler.plan_final(chunk)

    def in_flight(self, chunks: list[PlannedChunk], grouped: Any) -> None:
        """A rollout task run for `chunks` was submitted; `grouped` is its future (one chunk's groups per chunk).
        They are committed in order, one shard per chunk, by `plan_next` or `commit_remaining`."""
        self.window.add_task(chunks, grouped)

    # ---- commit -----------------------------------------------------------------------------------------------

    def _commit_oldest(self) -> None:
        planned, future = self.window.pop()
        self._commit(planned.chunk, self.ops.result(future))

    def _commit(self, chunk: int, grouped: Any) -> None:
        d = self.cfg.datagen
        moves = self.committer.commit(chunk, grouped)
        kept, dropped = len(grouped.groups), dict(grouped.dropped)
        grouped.release()  # the task run's Prefect state holds it on: let that be its counts, not its items
        if moves is None:
            self.logger.info("chunk %d: thrown away uncommitted, the target of %s groups is reached", chunk,
                             d.target_groups)
            return
        self.last_committed_chunk = chunk
        if self.progress_throttle.due():
            self._report_progress()
        if self.curriculum is not None:
            for move in moves:
                self.logger.info("curriculum: %s level %d -> %d (recent pass rate %.2f)", move["family"],
                                 move["from"], move["to"], move["pass_rate"])
            if moves or self.curriculum_throttle.due():  # a new table per chunk was an API call per chunk
                self._publish_curriculum(chunk)
        self.ops.chunk_committed(groups_kept=kept, rollouts=grouped.rollouts,
                                 detail=f"chunk {chunk}: kept {kept} groups, dropped {dropped}")

    def _publish_curriculum(self, chunk: int) -> None:
        from prefect.artifacts import create_table_artifact

        d = self.cfg.datagen
        best_effort(create_table_artifact, table=self.curriculum.table(), key=artifact_key(d.run_id, "curriculum"),
                    description=f"{self.env_name} curriculum after chunk {chunk} of run {d.run_id}")

    def commit_remaining(self) -> None:
        """Commit every chunk still in flight; after a stop signal only those that finish within the grace period
        (the rest are abandoned uncommitted; a rerun redoes them)."""
        while self.window:
            if self.stopping and not self.ops.finishes_in_grace(self.window.oldest()):
                break
            self._commit_oldest()

    # ---- outcome ----------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Totals of the producer's committed chunks and this session's rates; written to stats-<producer>.json,
        the run's summary artifact and the log."""
        d = self.cfg.datagen
        seconds = time.perf_counter() - self.started
        summary = {**summarize(self.store, self.cfg, seconds, self.committer.session, self.committer.intervals),
                   **self.sampler.summary()}
        summary = whole_run_totals(summary, read_discarded(self.store, d.run_id, d.producer))
        if (message := target_missed_message(summary)) is not None:
            self.logger.warning(message)
            summary["stop_message"] = message
        self.store.write_run_file(d.run_id, f"stats-{d.producer}.json", json.dumps(summary, indent=2))
        rows = [{"metric": k, "value": json.dumps(v) if isinstance(v, dict) else v} for k, v in summary.items()]
        self.ops.summary_artifact(rows, key=artifact_key(d.run_id, "summary"),
                                  description=f"{self.env_name} datagen summary for run {d.run_id}",
                                  store_dir=summary["store"])
        self.logger.info("summary: %s", json.dumps(summary))
        return summary

    def _send_held_back_reports(self) -> None:
        """The progress and curriculum artifacts as the run ends, where a throttle held back the latest."""
        reached = self.ops.progress is not None and self.ops.progress.target_reached  # the artifact says 100% then
        held = self.progress_throttle.held_back()
        if self.progress_id is None or (held and not reached):
            self._report_progress()
        if self.curriculum is not None and self.curriculum_throttle.held_back():
            self._publish_curriculum(self.last_committed_chunk)

    def outcome(self) -> Any:
        """The one place the run's end state is decided; returns what the pipeline flow returns.

        Stopped by a signal: the runs are marked Cancelled (the process exits at once if chunks were abandoned).
        A target missed within `max_items`: Failed, with the true numbers (run_datagen does not retry it).
        Otherwise the run completes with its summary.
        """
        self._send_held_back_reports()
        self.committer.folder.fold_if_due()  # a run from before folding, resumed: fold its backlog before reading it
        summary = self.summary()
        if self.stopping:
            return self.ops.stopped(summary, abandoned=self.window.chunks())
        self.ops.finished()
        if (message := summary.get("stop_message")) is not None:
            from prefect.states import Failed

            return Failed(message=message)
        return summary
