"""datagen.target_groups and the curriculum end to end: real Prefect server, real local policy server, kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from factory.curriculum import Curriculum, CurriculumSettings, ItemOutcome
from factory.sampling import chunk_stats_name, curriculum_state_name
from factory.store import ShardStore

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
PRODUCER = "intern-bootcamp"
CURRICULUM = {"enabled": True, "window_items": 2, "min_items": 1}


def params(policy_server, store_root: Path, run_id: str, target: int, **datagen) -> dict:
    base_url, model = policy_server
    return {
        # The tiny random policy never solves anything: every family's level descends from 3. Equal-score
        # groups are kept here so the run's yield is known and the target test does not depend on luck.
        "env": {"group_size": 4, "max_tokens": 8, "tokenizer_name": model, "difficulties": [3],
                "ensure_scores_are_not_same": False},
        "openai": {"base_url": base_url, "model_name": "tiny"},
        "datagen": {"store_root": str(store_root), "run_id": run_id, "chunk_items": 4, "score_workers": 1,
                    "target_groups": target, "curriculum": CURRICULUM, **datagen},
    }


def replayed_plans(store: ShardStore, run_id: str, lag: int) -> dict[int, dict]:
    """The plan each committed chunk should have used: the curriculum after chunks <= k - lag, replayed."""
    state = json.loads((store.run_dir(run_id) / curriculum_state_name(PRODUCER)).read_text())
    fresh = Curriculum(CurriculumSettings(**CURRICULUM), list(state["families"]), levels=(1, 5), start_level=3)
    plans, after, initial = {}, {}, fresh.plan()
    chunks = sorted(r.chunk for r in store.committed(run_id).values())
    for k in chunks:
        before = [j for j in after if j <= k - lag]
        plans[k] = after[max(before)] if before else initial
        stats = json.loads((store.run_dir(run_id) / chunk_stats_name(PRODUCER, k)).read_text())
        fresh.apply(k, [ItemOutcome.from_list(r) for r in stats["curriculum"]], stats["groups_kept_by_family"])
        after[k] = fresh.plan()
    assert fresh.to_dict() == state  # the saved state is the replay of the committed chunks
    return plans


def test_target_reached_exactly_with_curriculum_state_artifact_and_levels_on_groups(prefect_server, policy_server,
                                                                                   tmp_path):
    from prefect.artifacts import Artifact

    from flows.datagen import intern_bootcamp_datagen

    summary = intern_bootcamp_datagen(**params(policy_server, tmp_path, "target", 10))
    store = ShardStore(tmp_path)
    assert store.count("target") == summary["groups_kept"] == 10  # 12 items tried, the last chunk trimmed by 2
    assert summary["stop_reason"] == "target_groups" and summary["items_tried"] == 12
    assert summary["trimmed_over_target"] == 2
    levels = {g.difficulty for g in store.iter_groups("target")}
    assert levels <= {1, 2, 3} and 3 in levels
    assert min(summary["curriculum_levels"].values()) < 3  # never solved: levels went down
    assert Artifact.get("target-curriculum") is not None
    progress = Artifact.get("target-progress")  # says the target was reached, whatever chunks were left unplanned
    assert float(progress.data) == 100.0 and "target of 10 groups reached" in progress.description
    plans = replayed_plans(store, "target", lag=2)
    for k, plan in plans.items():
        assert json.loads((store.run_dir("target") / chunk_stats_name(PRODUCER, k)).read_text())["plan"] == plan

    again = intern_bootcamp_datagen(**params(policy_server, tmp_path, "target", 10))
    assert again["session_chunks"] == 0 and store.count("target") == 10


def test_kill_9_mid_target_run_then_rerun_reaches_exactly_the_target(prefect_server, policy_server, tmp_path):
    # One chunk per task run: commits spread out, so the kill lands between them (see test_datagen_flow's kill test)
    job = params(policy_server, tmp_path, "killed", 30, chunks_in_flight=1, min_task_s=0)
    job["env"]["max_tokens"] = 24
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
    assert 2 <= len(before) < 8

    from flows.datagen import intern_bootcamp_datagen

    summary = intern_bootcamp_datagen(**job)
    after = store.committed("killed")
    assert store.count("killed") == summary["groups_kept"] == 30 and summary["stop_reason"] == "target_groups"
    assert sorted(r.chunk for r in after.values()) == list(range(8))  # 32 items, the last chunk trimmed to 2
    for name, record in before.items():
        assert after[name].sha256 == record.sha256
    groups = list(store.iter_groups("killed"))
    assert len({g.group_id for g in groups}) == len({g.item_key for g in groups}) == 30
    # Chunks drawn after the restart used the plan rebuilt from the committed chunks, as an unbroken run would.
    plans = replayed_plans(store, "killed", lag=1)
    for k, plan in plans.items():
        assert json.loads((store.run_dir("killed") / chunk_stats_name(PRODUCER, k)).read_text())["plan"] == plan
    assert store.verify("killed") == []


def test_a_missed_target_fails_without_retries_with_the_true_numbers_and_a_resume_reports_the_whole_run(
        prefect_server, policy_server, tmp_path):
    from prefect.client.orchestration import get_client

    from factory.run_outcome import TargetMissed
    from flows.datagen import intern_bootcamp_datagen

    job = params(policy_server, tmp_path, "missed", 50, max_items=8)
    started = time.monotonic()
    with pytest.raises(TargetMissed) as caught:
        intern_bootcamp_datagen(**job)
    assert time.monotonic() - started < 60  # no flow retries (2 x 30 s)
    store = ShardStore(tmp_path)
    kept = store.count("missed")
    message = str(caught.value)
    assert message.startswith(f"missed the target: kept {kept} of datagen.target_groups=50 groups")
    assert "(8 items tried, 32 rollouts;" in message  # 2 chunks of 4 items, group_size 4
    summary = json.loads((store.run_dir("missed") / f"stats-{PRODUCER}.json").read_text())
    assert summary["groups_kept"] == kept and summary["items_tried"] == 8 and summary["rollouts"] == 32
    from prefect.client.schemas.sorting import FlowRunSort

    # Newest first: the session's server holds every earlier test's runs (the API's default page is 200).
    with get_client(sync_client=True) as client:
        recent = client.read_flow_runs(sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=50)
        runs = [r for r in recent if r.parameters.get("datagen", {}).get("run_id") == "missed"]
    (parent,) = runs
    assert parent.state.is_failed() and parent.run_count == 1 and message in parent.state.message

    # A rerun with nothing left to do still reports the whole run, not "0 groups kept".
    with pytest.raises(TargetMissed) as again:
        intern_bootcamp_datagen(**job)
    assert str(again.value) == message
