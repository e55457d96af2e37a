"""The datagen flow writing to an s3:// store (a local moto server, a real Prefect server and a real local policy
server, all started by the test): each chunk committed once, readable by the store's readers, a rerun or a resume
after kill -9 adds nothing twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from factory.store_object import ObjectShardStore, open_store
from tests.moto_s3 import bucket, s3_endpoint  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def params(policy_server, root: str, files: Path, run_id: str, **env) -> dict:
    base_url, model = policy_server
    return {
        "env": {"group_size": 4, "total_items": 12, "max_tokens": 8, "tokenizer_name": model,
                "ensure_scores_are_not_same": False, **env},
        "openai": {"base_url": base_url, "model_name": "tiny"},
        "datagen": {"store_root": root, "run_files_dir": str(files), "run_id": run_id, "chunk_items": 4,
                    "score_workers": 1},
    }


def test_datagen_commits_each_chunk_once_to_an_object_store(prefect_server, policy_server, bucket, tmp_path):
    from flows.datagen import intern_bootcamp_datagen

    fs, name = bucket
    root = f"s3://{name}/store"
    job = params(policy_server, root, tmp_path / "files", "s3-run")
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


def test_kill_9_mid_run_then_rerun_commits_each_chunk_once_on_an_object_store(prefect_server, policy_server, bucket,
                                                                                tmp_path):
    _, name = bucket
    root = f"s3://{name}/store"
    job = params(policy_server, root, tmp_path / "files", "killed", total_items=40, max_tokens=24)
    # One chunk per task run: commits spread out, so the kill lands between them (see test_datagen_flow's kill test)
    job["datagen"].update(chunks_in_flight=1, min_task_s=0)
    script = ("import json, sys; from flows.datagen import intern_bootcamp_datagen; "
              "intern_bootcamp_datagen(**json.loads(sys.argv[1]))")
    process = subprocess.Popen([sys.executable, "-c", script, json.dumps(job)], cwd=REPO, env=os.environ.copy(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and len(open_store(root).committed("killed")) < 2:
            assert process.poll() is None, "the flow ended before it could be killed; make the job longer"
            time.sleep(0.2)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    before = open_store(root).committed("killed")
    assert 2 <= len(before) < 10

    from flows.datagen import intern_bootcamp_datagen

    summary = intern_bootcamp_datagen(**job)
    store = open_store(root)
    after = store.committed("killed")
    assert summary["chunks_committed"] == 10 and summary["session_chunks"] == 10 - len(before)
    for shard, record in before.items():  # what was committed before the kill is untouched
        assert after[shard].sha256 == record.sha256 and after[shard].committed_at == record.committed_at
    groups = list(store.iter_groups("killed"))
    assert len(groups) == len({g.group_id for g in groups}) == 40
    assert store.verify("killed") == []
