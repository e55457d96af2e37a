"""The datagen flow writing to an s3:// store (a local moto server, a real Prefect server and a real local policy
server, all started by the test): each chunk committed once, readable by the store's readers, a rerun adds nothing."""

from __future__ import annotations

import json

import pyarrow.fs as pafs

import pytest

from factory.store_object import ObjectShardStore, open_store
from tests.moto_s3 import bucket, s3_endpoint  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def policy_server(tmp_path_factory):
    from factory.inference.local_server import start_local_server
    from factory.inference.tiny_model import make_tiny_policy

    model = make_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny")
    with start_local_server(model) as handle:
        yield handle.base_url, str(model)


def test_datagen_commits_each_chunk_once_to_an_object_store(prefect_server, policy_server, bucket, tmp_path):
    from flows.datagen import intern_bootcamp_datagen

    fs, name = bucket
    base_url, model = policy_server
    root = f"s3://{name}/store"
    job = {
        "env": {"group_size": 4, "total_items": 12, "max_tokens": 8, "tokenizer_name": model,
                "ensure_scores_are_not_same": False},
        "openai": {"base_url": base_url, "model_name": "tiny"},
        "datagen": {"store_root": root, "run_files_dir": str(tmp_path / "files"), "run_id": "s3-run",
                    "chunk_items": 4, "score_workers": 1},
    }
    summary = intern_bootcamp_datagen(**job)
    store = open_store(root)
    assert isinstance(store, ObjectShardStore)
    records = store.committed("s3-run")
    assert sorted(records) == [f"intern-bootcamp-{k:08d}.parquet" for k in range(3)]
    groups = list(store.iter_groups("s3-run", validate=True))
    assert summary["chunks_committed"] == 3 and summary["groups_kept"] == len(groups) == 12
    assert len({g.group_id for g in groups}) == 12
    assert summary["store"] == f"{root}/s3-run"
    # The run's own files are local; the bucket holds only shards and their commit records.
    files = tmp_path / "files" / "s3-run"
    assert (files / "config-intern-bootcamp.yaml").is_file()
    assert json.loads((files / "stats-intern-bootcamp.json").read_text())["rollouts"] == 48
    keys = sorted(i.path.split("/s3-run/", 1)[1] for i in fs.get_file_info(
        pafs.FileSelector(f"{name}/store/s3-run", recursive=True)) if i.type == pafs.FileType.File)
    assert keys == sorted([f"commits/{r}.json" for r in records] + [f"shards/{r}" for r in records])
    stamps = {shard: r.committed_at for shard, r in records.items()}

    again = intern_bootcamp_datagen(**job)  # the same run id: every chunk is committed already
    assert again["session_chunks"] == 0 and again["chunks_committed"] == 3
    fresh = open_store(root)
    assert {s: r.committed_at for s, r in fresh.committed("s3-run").items()} == stamps  # no record rewritten
    assert fresh.count("s3-run") == 12
