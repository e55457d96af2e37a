"""The datagen flow end to end on a real Prefect server and a real local policy server, and its resume after kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from factory.store import ShardStore

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def params(policy_server, store_root: Path, run_id: str, **env) -> dict:
    base_url, model = policy_server
    return {
        "env": {"group_size": 4, "total_items": 12, "max_tokens": 8, "tokenizer_name": model,
                "ensure_scores_are_not_same": False, **env},
        "openai": {"base_url": base_url, "model_name": "tiny"},
        "datagen": {"store_root": str(store_root), "run_id": run_id, "chunk_items": 4, "score_workers": 1},
    }


def test_flow_writes_readable_shards_with_tokens_stats_and_artifacts(prefect_server, policy_server, tmp_path):
    from prefect.artifacts import Artifact

    from flows.datagen import intern_bootcamp_datagen

    summary = intern_bootcamp_datagen(**params(policy_server, tmp_path, "flow-1"))
    store = ShardStore(tmp_path)
    groups = list(store.iter_groups("flow-1"))
    assert summary["chunks_committed"] == 3 and summary["groups_kept"] == len(groups) == 12
    assert store.verify("flow-1") == []
    for group in groups:
        assert group.env == "intern_bootcamp" and group.group_size == 4
        for tokens, masks, logprobs in zip(group.tokens, group.masks, group.inference_logprobs):
            prompt = sum(1 for m in masks if m == -100)
            assert 0 < prompt < len(tokens)
            assert masks[prompt:] == tokens[prompt:]  # completion positions are trained on
            assert logprobs[:prompt] == [1.0] * prompt and all(lp <= 0 for lp in logprobs[prompt:])
    assert len({g.group_id for g in groups}) == 12
    assert (store.run_dir("flow-1") / "config-intern-bootcamp.yaml").is_file()
    stats = json.loads((store.run_dir("flow-1") / "stats-intern-bootcamp.json").read_text())
    assert stats["rollouts"] == 48 and stats["session_rollouts_per_s"] > 0
    chunk_stats = json.loads((store.run_dir("flow-1") / "stats-intern-bootcamp-00000000.json").read_text())
    assert len(chunk_stats["flow_run_id"]) == 36  # view-run links the run to this Prefect flow run
    assert Artifact.get("flow-1-summary") is not None
    assert Artifact.get("flow-1-progress") is not None

    again = intern_bootcamp_datagen(**params(policy_server, tmp_path, "flow-1"))
    assert again["session_chunks"] == 0 and store.count("flow-1") == 12  # a rerun adds nothing


def test_the_flow_folds_its_chunk_stats_and_a_rerun_reads_them(prefect_server, policy_server, tmp_path, monkeypatch):
    from factory import chunk_stats
    from flows.datagen import intern_bootcamp_datagen

    monkeypatch.setattr(chunk_stats, "FOLD_CHUNKS", 2)  # the flow runs in this process
    summary = intern_bootcamp_datagen(**params(policy_server, tmp_path, "fold-1"))
    run_dir = ShardStore(tmp_path).run_dir("fold-1")
    names = sorted(n for n in os.listdir(run_dir) if n.startswith("stats-intern-bootcamp"))
    assert names == ["stats-intern-bootcamp-00000002.json", "stats-intern-bootcamp.chunks-00000000-00000001.json",
                     "stats-intern-bootcamp.json"]
    assert summary["chunks_committed"] == 3 and summary["groups_kept"] == 12 and summary["rollouts"] == 48
    again = intern_bootcamp_datagen(**params(policy_server, tmp_path, "fold-1"))
    assert again["session_chunks"] == 0 and again["chunks_committed"] == 3 and again["rollouts"] == 48
    assert again["items_tried"] == summary["items_tried"] == 12


def test_kill_9_mid_run_then_rerun_loses_nothing_and_duplicates_nothing(prefect_server, policy_server, tmp_path):
    job = params(policy_server, tmp_path, "killed", total_items=40, max_tokens=24)
    # One chunk per task run (min_task_s 0): with bundling, a fast machine generated chunks 1-9 in one task run and
    # committed them within ~5 ms, between two polls, so the kill came after the last chunk (CI, 2026-11-28).
    job["datagen"].update(chunks_in_flight=1, min_task_s=0)
    script = ("import json, sys; from flows.datagen import intern_bootcamp_datagen; "
              "intern_bootcamp_datagen(**json.loads(sys.argv[1]))")
    process = subprocess.Popen([sys.executable, "-c", script, json.dumps(job)], cwd=REPO, env=os.environ.copy(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    store = ShardStore(tmp_path)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(store.committed("killed")) < 2:
        assert process.poll() is None, "the flow ended before it could be killed; make the job longer"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    before = store.committed("killed")
    assert 2 <= len(before) < 10

    from flows.datagen import intern_bootcamp_datagen

    summary = intern_bootcamp_datagen(**job)
    after = store.committed("killed")
    assert summary["chunks_committed"] == 10
    assert summary["session_chunks"] == 10 - len(before)
    for name, record in before.items():  # what was committed before the kill is untouched
        assert after[name].sha256 == record.sha256
    groups = list(store.iter_groups("killed"))
    assert len(groups) == 40
    assert len({g.group_id for g in groups}) == 40
    assert len({g.item_key for g in groups}) == len({g.item_key for g in groups})
    assert store.verify("killed") == []


def test_fast_chunks_share_a_rollout_task_run_and_each_is_still_its_own_shard(prefect_server, policy_server, tmp_path):
    """datagen.min_task_s: once a chunk is measured, one task run covers the chunks that make that much work."""
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.datagen import intern_bootcamp_datagen

    job = params(policy_server, tmp_path, "bundled", total_items=24)
    job["datagen"].update(min_task_s=600.0)  # every chunk is "fast": task runs as large as allowed
    summary = intern_bootcamp_datagen(**job)
    store = ShardStore(tmp_path)
    assert summary["chunks_committed"] == 6 and len(store.committed("bundled")) == 6 and store.count("bundled") == 24
    assert store.verify("bundled") == []
    stats = json.loads((store.run_dir("bundled") / "stats-intern-bootcamp-00000000.json").read_text())
    flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[UUID(stats["flow_run_id"])]))
    deadline, names = time.monotonic() + 20, []
    while time.monotonic() < deadline:  # task runs reach the server as events
        with get_client(sync_client=True) as client:
            names = sorted(run.name for run in client.read_task_runs(flow_run_filter=flow_runs)
                           if run.name.startswith("rollout-"))
        if len(names) == 3:
            break
        time.sleep(0.5)
    # the first two before any chunk is measured (the window holds 2 task runs), then the other four in one
    assert [name.rsplit("-", 2)[1:] for name in names] == [["0", "0"], ["1", "1"], ["2", "5"]], names
    again = intern_bootcamp_datagen(**job)
    assert again["session_chunks"] == 0 and store.count("bundled") == 24
