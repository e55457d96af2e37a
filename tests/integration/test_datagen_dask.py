"""The datagen flow with `datagen.task_runner: dask` (a LocalCluster of worker processes) on a real Prefect server."""

from __future__ import annotations

import pytest

from factory.store import ShardStore

pytestmark = pytest.mark.integration


def test_dask_process_workers_complete_the_run_without_duplicates(prefect_server, tmp_path):
    from factory.inference.local_server import start_local_server
    from factory.inference.tiny_model import make_tiny_policy
    from flows.datagen import intern_bootcamp_datagen

    model = make_tiny_policy(tmp_path / "policy")
    job = {
        "env": {"group_size": 4, "total_items": 12, "max_tokens": 8, "tokenizer_name": str(model),
                "ensure_scores_are_not_same": False},
        "datagen": {"store_root": str(tmp_path / "data"), "run_id": "dask-run", "chunk_items": 3,
                    "task_runner": "dask", "dask_workers": 2, "dask_threads_per_worker": 2},
    }
    with start_local_server(model) as server:
        job["openai"] = {"base_url": server.base_url, "model_name": "tiny"}
        summary = intern_bootcamp_datagen(**job)
        again = intern_bootcamp_datagen(**job)

    store = ShardStore(tmp_path / "data")
    assert store.verify("dask-run") == []
    assert summary["chunks_committed"] == 4 and summary["session_chunks"] == 4
    groups = list(store.iter_groups("dask-run"))
    assert len(groups) == summary["groups_kept"] == 12
    assert len({g.group_id for g in groups}) == 12
    assert len({g.item_key for g in groups}) == 12
    assert all(g.env == "intern_bootcamp" and g.group_size == 4 and len(g.tokens) == 4 for g in groups)
    assert summary["rollouts"] == 48
    # Chunks ran in the Dask workers, and a rerun on Dask finds every chunk committed.
    assert again["session_chunks"] == 0 and store.count("dask-run") == 12
