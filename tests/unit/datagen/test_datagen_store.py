"""Datagen on an object store: shards and records on the store (a local moto server started by the test), run files
in a local directory, each chunk committed once."""

from __future__ import annotations

import json

from factory.datagen.store import ObjectDatagenStore, open_datagen_store, run_location
from factory.datagen.summary import summarize
from factory.run_outcome import clean_start, forget_stats, read_discarded, record_discarded
from factory.sampling import DynamicSampling, chunk_stats_name
from factory.store import ShardStore
from factory.store_object import open_store
from factory.synthetic import synthetic_groups
from tasks.shards import write_shard
from tests.moto_s3 import bucket, s3_endpoint  # noqa: F401 - fixtures


def _groups(n: int, start: int = 0):
    return list(synthetic_groups(n, start=start, group_size=2, seq_len=8, env="e"))


def test_a_local_root_is_a_shard_store_with_its_run_files_beside_the_shards(tmp_path):
    store = open_datagen_store(str(tmp_path / "data"), str(tmp_path / "unused"))
    assert isinstance(store, ShardStore)
    assert run_location(store, "r") == str((tmp_path / "data" / "r").absolute())


def test_an_s3_root_keeps_shards_on_the_store_and_run_files_local(bucket, tmp_path):
    fs, name = bucket
    store = open_datagen_store(f"s3://{name}/p", str(tmp_path / "files"))
    assert isinstance(store, ObjectDatagenStore)
    assert store.run_dir("r") == tmp_path / "files" / "r"
    store.write_run_file("r", "config-w.yaml", "a: 1\n")
    assert (tmp_path / "files" / "r" / "config-w.yaml").read_text() == "a: 1\n"
    assert run_location(store, "r") == f"s3://{name}/p/r"
    assert store.runs() == []  # no run file went to the bucket


def test_write_shard_commits_a_chunk_once_on_an_object_store(bucket):
    _, name = bucket
    root = f"s3://{name}/store"
    first = write_shard(root, "run", "w", 0, _groups(3))
    again = write_shard(root, "run", "w", 0, _groups(3, start=50))  # a retried task, a resumed run
    assert not first.skipped and again.skipped and again.sha256 == first.sha256
    reader = open_store(root)
    assert [g.group_id for g in reader.iter_groups("run")] == [g.group_id for g in _groups(3)]
    assert list(reader.committed("run")) == ["w-00000000.parquet"]


def test_clean_start_sampler_and_summary_read_the_records_of_the_store(bucket, tmp_path):
    _, name = bucket
    root = f"s3://{name}/store"
    store = open_datagen_store(root, str(tmp_path / "files"))
    for chunk in (0, 1):
        store.write_run_file("run", chunk_stats_name("w", chunk), json.dumps(
            {"items": 2, "groups_kept": 2, "rollouts": 4, "completion_tokens": 8, "scored": 4, "score_sum": 2.0,
             "dropped": {}}))
    write_shard(root, "run", "w", 0, _groups(2))  # chunk 1's stats were written, its commit never happened
    (store.run_dir("run") / ".stats-w-00000002.json.0123abcd.tmp").write_text("{}")
    removed = clean_start(store, "run", "w")
    assert sorted(removed) == [".stats-w-00000002.json.0123abcd.tmp", chunk_stats_name("w", 1)]
    assert (store.run_dir("run") / chunk_stats_name("w", 0)).is_file()

    sampler = DynamicSampling(store, run_id="run", producer="w", chunk_items=2, total_items=6)
    assert sampler.committed_chunks == {0} and sampler.committed_groups == 2 and sampler.todo_chunks() == 2

    record_discarded(store, "run", "w", items=2, rollouts=4, groups=1)
    assert read_discarded(store, "run", "w")["items"] == 2
    forget_stats(store, "run", chunk_stats_name("w", 0))
    assert not (store.run_dir("run") / chunk_stats_name("w", 0)).exists()

    class Cfg:
        class datagen:
            run_id, producer = "run", "w"

    from collections import Counter

    summary = summarize(store, Cfg, 1.0, Counter(), [])
    assert summary["chunks_committed"] == 1 and summary["store"] == f"{root}/run"


def test_preflight_checks_the_local_run_files_dir_of_an_s3_store(bucket, tmp_path):
    import pytest

    from factory.preflight import PreflightError, preflight
    from flows.datagen import build_job_config
    from flows.datagen_cli import output_dir

    _, name = bucket
    (tmp_path / "file").write_text("")

    def job(run_files_dir):
        values = {"datagen": {"store_root": f"s3://{name}/s", "run_files_dir": run_files_dir, "run_id": "r"}}
        return build_job_config("environments.intern_bootcamp:InternBootcampEnv", values=values)

    with pytest.raises(PreflightError, match=r"^preflight: datagen.run_files_dir='.*file/x': not writable"):
        preflight(job(str(tmp_path / "file" / "x")))
    assert output_dir(job(str(tmp_path / "files"))) == tmp_path / "files" / "r"  # process/evaluate outputs
