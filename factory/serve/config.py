"""Config of the batching API (`run-api`, flows/serve.py): one pydantic model, YAML + dotted CLI overrides."""

from __future__ import annotations

from pathlib import Path

from typing import Literal

from pydantic import Field, field_validator

from factory.config import ConfigError, FactoryConfig


class ServeConfig(FactoryConfig):
    """Where the service listens, what it serves from, and how it packs batches."""

    host: str = Field("0.0.0.0", description="Interface to bind (Atropos's run-api binds 0.0.0.0).")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (Atropos's default is 8000).")
    store_root: str = Field("./data", description="Shard store root (a directory, or s3://bucket/prefix with a local state_path): followed runs are read and posted groups are committed here.")
    ingest_run: str = Field("api", description="Run that groups POSTed to /scored_data(_list) are committed to.")
    ingest_producer: str = Field("api", description="Producer name of ingest shards; one per service sharing a store.")
    follow_runs: list[str] = Field(default_factory=list, description="Store runs whose shards are served as they are committed; '*' follows every run.")
    follow_interval_s: float = Field(0.5, gt=0, description="Seconds between scans of followed runs' commit logs.")
    state_path: str | None = Field(
        None, description="SQLite file of served state; default <store_root>/<ingest_run>/serve-state.sqlite. Required (a "
        "local path) when store_root is an object store URL (s3://bucket/prefix).",
    )
    api_token: str | None = Field(None, description="If set, every request needs 'Authorization: Bearer <token>'.")
    max_body_mb: float = Field(256.0, gt=0, description="Largest request body accepted (compressed and decompressed), else 413.")
    gzip_level: int = Field(
        1, ge=0, le=9, description="gzip level (zlib's 1-9) of responses to clients that accept gzip; 0 disables. With ISA-L "
        "(installed with the factory) levels 1-3, 4-6 and 7-9 are its levels 1, 2 and 3.",
    )
    gzip_min_bytes: int = Field(1000, ge=0, description="Responses smaller than this are sent uncompressed.")
    gzip_loopback: bool = Field(
        False, description="Gzip responses to clients on this host (loopback) too. Off (default): they get plain JSON, "
        "since over loopback gzip saves no transfer time and costs CPU at both ends (a trainer's inflate of a 7 MB "
        "/batch body took 35-55 ms, most of the request; bench/RESULTS.md, issue 29). Clients elsewhere are gzipped "
        "as before.",
    )
    max_policy_lag: int | None = Field(
        None, ge=0, description="Skip (and count) groups more than this many policy versions behind the trainer's step; None keeps all."
    )
    env_weights: dict[str, float] = Field(default_factory=dict, description="Batch share weight per env name for groups from followed runs (default 1).")
    env_min_batch_allocation: dict[str, float] = Field(
        default_factory=dict, description="Minimum fraction of each batch per env name for groups from followed runs."
    )
    commit_max_groups: int = Field(1024, ge=1, description="Most posted groups committed together in one shard (group commit).")
    decode_threads: int = Field(
        1, ge=1, description="Threads that gunzip, decode and build Arrow rows of posted bodies (the msgspec parts hold "
        "the GIL; the number lists, read natively, do not).",
    )
    commit_linger_ms: float = Field(
        10.0, ge=0, description="Longest a commit waits for posts whose bodies are being decoded at that moment, to share "
        "one shard's fixed cost; a lone client never waits. 0 commits at once.",
    )
    commit_linger_queued: bool = Field(
        True, description="A commit also lingers (up to commit_linger_ms) for posts whose bodies are read and queued "
        "for a decoder, not only for those being decoded. One-group posts from 8 clients: ~4-5 groups per shard "
        "instead of ~3.9, 0.91-0.98x the server CPU per group, groups/s unchanged within the noise (bench/RESULTS.md, "
        "issue 29). false: only bodies being decoded are waited for.",
    )
    commit_concurrency: int = Field(
        1, ge=1, description="Shards of posted groups being written at once. 1 (default): one writer; posts that "
        "arrive meanwhile share the next shard. 2: they start the next one at once (the commit log's appends stay "
        "one at a time): shorter waits where CPU is idle, but ~1/3 smaller shards and 5-12% more CPU per group "
        "(bench/RESULTS.md, issue 29).",
    )
    commit_pipeline: bool = Field(
        True, description="The next commit of posted groups may start encoding its shard as soon as the one before "
        "has written its bytes, while that one still waits for its fsyncs and commit record (at most one shard "
        "encoding at a time, one more commit in flight than commit_concurrency). Commits are still answered in the "
        "order they started, each only once its own shard is committed. false: a commit starts only when a writer "
        "is free (bench/RESULTS.md, issue 29).",
    )
    ingest_row_group_groups: int = Field(16, ge=1, description="Groups per Parquet row group in ingest shards (smaller reads per batch).")
    payload_cache_mb: float = Field(
        8.0, ge=0, description="0 turns off the cache of decoded row groups; otherwise the row group of the last "
        "row a batch took is kept, whatever its size, for the next batch, which starts there (batches take "
        "consecutive rows). Keeping more only raised RSS while draining (bench.serve.drain_rss); it is dropped once "
        "no batch can be formed.",
    )
    prefetch: bool = Field(True, description="Form and encode the next batch in the background after each /batch.")
    batch_order: Literal["oldest_first", "newest_first"] = Field(
        "oldest_first", description="Which queued groups /batch takes first. oldest_first (default): arrival order, so "
        "no group waits behind newer ones and staleness stays bounded. newest_first: the most recent first, as "
        "Atropos serves (it forms every batch it can at once and hands out the newest; here each batch is formed "
        "from the newest groups at the time of the request).",
    )
    batch_metadata: bool = Field(False, description="Add group_id, env and policy_version to each group in /batch responses.")
    ingest_budget_mb: float = Field(
        48.0, gt=0, description="Decompressed bytes of posted bodies decoded and awaiting commit at once (bounds memory); "
        "more requests wait in line.",
    )
    ingest_waiting_mb: float = Field(
        512.0, gt=0, description="Bytes of bodies allowed to wait for the ingest budget; beyond that (or after ingest_wait_s) 503 + Retry-After.",
    )
    ingest_wait_s: float = Field(30.0, gt=0, description="Longest a post waits for the ingest budget before a 503 + Retry-After.")
    strict: bool = Field(
        False, description="Refuse (422, naming the field) posted groups whose masks/advantages/logprobs/messages/overrides "
        "don't line up with tokens, that give strings for numbers or floats for ints, NaN or infinities in any spelling, "
        "or negative token ids (or ids >= vocab_size); by default they are stored as sent, as Atropos does, and "
        "misaligned fields are counted in /status 'unaligned'.",
    )
    vocab_size: int | None = Field(
        None, ge=1, description="With strict: token ids must be below this (the policy's vocabulary size); None: no bound.",
    )
    log_level: str = Field("info", description="Log level of the service (debug, info, warning, error).")
    recycle_idle_s: float = Field(
        0.5, ge=0, description="run-api only: once no batch can be formed (fewer than a batch may be queued), no "
        "commit or request is in flight and nothing arrived for this many seconds (and for 4x its longest recent "
        "pause), the process stops serving as at a SIGTERM and execs itself in place (same "
        "pid, listening socket kept, requests meanwhile wait in the backlog) so that what the first post loaded "
        "(pyarrow, ~60 MiB) is given back: RSS returns to idle after a drain (factory/serve/recycle.py, "
        "bench/RESULTS.md, issue 29). Idle keep-alive connections are closed; the new image stays dormant (no "
        "pyarrow) until a post, a followed run's commit, a replay, /latest_example, /reset_data or a registration "
        "while it holds groups. 0 never recycles.",
    )
    recycle_min_interval_s: float = Field(
        60.0, ge=0, description="Least time between two recycles unless the process worked 10 s of CPU since the "
        "last: a recycle costs ~0.7 s of CPU (0.5 s to stop and start, 0.2 s to load pyarrow again at the next post; "
        "bench/RESULTS.md, issue 29), so at most ~1% of a core, or ~7% of the work between two.",
    )
    shutdown_grace_s: float = Field(10.0, ge=0, description="On SIGTERM/SIGINT, seconds requests in flight get to finish before the service commits, closes and exits.")

    @field_validator("env_min_batch_allocation")
    @classmethod
    def _fractions(cls, value: dict[str, float]) -> dict[str, float]:
        for name, fraction in value.items():
            if not 0.0 <= fraction <= 1.0:
                raise ValueError(f"env_min_batch_allocation[{name!r}] is {fraction}; use a fraction between 0 and 1")
        return value

    @field_validator("env_weights")
    @classmethod
    def _weights(cls, value: dict[str, float]) -> dict[str, float]:
        for name, weight in value.items():
            if weight < 0:
                raise ValueError(f"env_weights[{name!r}] is {weight}; weights must be >= 0")
        return value

    @property
    def local_store_root(self) -> Path | None:
        """store_root as a local directory (a file:// URL's path); None where it is an object store URL."""
        if "://" in self.store_root and not self.store_root.startswith("file://"):
            return None
        return Path(self.store_root.removeprefix("file://"))

    def resolved_state_path(self) -> Path:
        if self.state_path:
            return Path(self.state_path)
        if self.local_store_root is None:
            raise ConfigError(f"store_root {self.store_root} is an object store URL: give state_path, a local file for "
                              "the served state (e.g. --state_path ./serve-state.sqlite), and keep it across restarts: "
                              "it is what keeps a served group from being served again")
        return Path(self.store_root) / self.ingest_run / "serve-state.sqlite"
