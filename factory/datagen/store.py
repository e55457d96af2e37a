"""The store a datagen run writes to: a local or shared path, or an object store (s3://bucket/prefix).

A datagen run keeps two kinds of things under its run: the committed shards (what every reader wants) and its
own run files (the resolved config, one stats file per committed chunk, the curriculum state, discarded counts,
the run's summary and the owner lock). On a local or shared root both live in `<root>/<run>/`. On an object store
the shards and their commit records go to the store (`ObjectShardStore.commit`: the shard object, then its
record; a chunk whose record exists is skipped, so a retried task or a resumed run commits each chunk once), and
the run files stay in a local directory, `datagen.run_files_dir` (default `./run-files`), as `<dir>/<run>/`:

- they are written often (a stats file per chunk, before its commit) and read by the run itself only: a resume
  restores the item count and the curriculum from them, so resume a run with the same `run_files_dir` (a shared
  path when workers of one run sit on several machines). Without them a resume still commits each chunk once
  (the store's records say which chunks are done) but counts items by chunk length, restarts the curriculum at
  its start level, and its summary's totals (rollouts, scores, drops) leave out the earlier sessions' chunks.
- the owner lock is a local file lock: it keeps two processes of one producer on one machine apart, not two
  machines. The object store's rule is one live writer per (run, producer) (factory/store_object.py).
- view-run shows the run's shards from the store; its datagen stats only where it is given the local files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from factory.store import ShardStore
from factory.store_object import ObjectShardStore, is_store_url

DEFAULT_RUN_FILES_DIR = "./run-files"


class ObjectDatagenStore(ObjectShardStore):
    """An object store for a datagen run: shards and commit records on the store, run files in a local directory
    (`run_files`), through a local `ShardStore` there that holds no shards."""

    def __init__(self, url: str, run_files: str | os.PathLike[str]) -> None:
        super().__init__(url)
        self.local = ShardStore(run_files)

    def __repr__(self) -> str:
        return f"ObjectDatagenStore({self.url!r}, run_files={str(self.local.root)!r})"

    def run_dir(self, run_id: str) -> Path:
        """The run's local directory of run files (its shards are at `run_location`)."""
        return self.local.run_dir(run_id)

    def write_run_file(self, run_id: str, name: str, text: str) -> Path:
        """Atomically write a run file (config, stats) in the run's local directory."""
        return self.local.write_run_file(run_id, name, text)

    def run_location(self, run_id: str) -> str:
        """Where the run's shards are: the store URL with the run appended (query kept)."""
        self._run(run_id)  # checks the name
        parts = urlsplit(self.url)
        return urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{run_id}"))


def open_datagen_store(store_root: str, run_files_dir: str | None = None) -> ShardStore | ObjectDatagenStore:
    """The store datagen writes to: an `ObjectDatagenStore` for an s3:// root (run files under `run_files_dir`,
    default `./run-files`), else a `ShardStore` (run files next to the shards; `run_files_dir` is not used)."""
    if is_store_url(store_root):
        return ObjectDatagenStore(store_root, run_files_dir or DEFAULT_RUN_FILES_DIR)
    return ShardStore(store_root)


def run_location(store: Any, run_id: str) -> str:
    """Where a run's shards are, for messages, summaries and artifact links: a URL or an absolute local path."""
    if hasattr(store, "run_location"):
        return store.run_location(run_id)
    return str(Path(store.run_dir(run_id)).absolute())


__all__ = ["ObjectDatagenStore", "open_datagen_store", "run_location", "DEFAULT_RUN_FILES_DIR"]
