"""How a datagen run ends: true totals with thrown-away chunks, a missed target as one line, a clean start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from factory.cli_errors import classify
from factory.run_outcome import (MISSED_PREFIX, TargetMissed, check_outcome, clean_start, dropped_wording,
                                 raise_if_target_missed, read_discarded, record_discarded, target_missed_message,
                                 whole_run_totals)
from factory.store import ShardStore
from factory.synthetic import synthetic_groups


def missed_summary(**overrides):
    summary = {"target_groups": 100, "max_items": 40, "items_tried": 40, "groups_kept": 29, "rollouts": 160,
               "dropped": {"failed": 0, "wrong_size": 0, "too_long": 0, "equal_scores": 11}, "stop_reason": "max_items"}
    return {**summary, **overrides}


def test_the_wording_matches_the_numbers():
    assert dropped_wording(29, {"equal_scores": 11, "too_long": 0}).startswith("most groups were kept: 29 of 40 kept (72%)")
    assert dropped_wording(3, {"equal_scores": 30, "too_long": 7}).startswith("most groups were dropped: 3 of 40")
    assert "30 equal_scores, 7 too_long" in dropped_wording(3, {"equal_scores": 30, "too_long": 7})
    assert dropped_wording(5, {"equal_scores": 0}) == "all 5 groups generated were kept"


def test_a_missed_target_is_one_line_with_the_true_numbers_and_the_fix():
    message = target_missed_message(missed_summary())
    assert message.startswith(MISSED_PREFIX) and "\n" not in message
    assert "kept 29 of datagen.target_groups=100" in message and "40 items tried, 160 rollouts" in message
    assert "most groups were kept" in message and "raise datagen.max_items to about 138" in message
    with pytest.raises(TargetMissed) as caught:
        check_outcome(missed_summary())
    assert classify(caught.value) == (1, message)  # the CLI's last line, exit 1, no traceback
    assert target_missed_message(missed_summary(groups_kept=100, stop_reason="target_groups")) is None
    assert target_missed_message(missed_summary(target_groups=None, stop_reason="total_items")) is None
    assert "no item gave a group" in target_missed_message(missed_summary(groups_kept=0))


def test_a_failed_pipeline_state_for_a_missed_target_raises_and_others_pass():
    from prefect.states import Completed, Failed

    with pytest.raises(TargetMissed, match="kept 29"):
        raise_if_target_missed(Failed(message=target_missed_message(missed_summary())))
    raise_if_target_missed(Completed())
    raise_if_target_missed(Failed(message="something else"))  # left to state.result()


def test_thrown_away_chunks_count_in_items_tried_and_rollouts_across_sessions(tmp_path: Path):
    store = ShardStore(tmp_path)
    assert read_discarded(store, "run", "p") == {"chunks": 0, "items": 0, "rollouts": 0, "groups": 0}
    record_discarded(store, "run", "p", items=4, rollouts=16, groups=3)
    record_discarded(store, "run", "p", items=4, rollouts=16, groups=2)  # a later session
    totals = whole_run_totals({"items_tried": 12, "rollouts": 48, "groups_kept": 10}, read_discarded(store, "run", "p"))
    assert totals["items_tried"] == 20 and totals["rollouts"] == 80 and totals["groups_kept"] == 10
    assert totals["chunks_thrown_away"] == 2 and totals["rollouts_thrown_away"] == 32
    assert read_discarded(store, "run", "other") == {"chunks": 0, "items": 0, "rollouts": 0, "groups": 0}


def test_clean_start_removes_temps_and_stats_of_uncommitted_chunks_only(tmp_path: Path):
    store = ShardStore(tmp_path)
    store.commit("run", "p", 0, synthetic_groups(2, group_size=2, seq_len=4, vocab=20, seed=0))
    run_dir, shards = store.run_dir("run"), store.shards_dir("run")
    (run_dir / "stats-p-00000000.json").write_text("{}")             # committed chunk: kept
    (run_dir / "stats-p-00000001.json").write_text("{}")             # commit failed or killed: removed
    (run_dir / "stats-p-2-00000001.json").write_text("{}")           # another producer's: kept
    (run_dir / "stats-p.json").write_text("{}")                      # the run summary: kept
    (run_dir / ".stats-p-00000001.json.0123456789ab.tmp").write_text("{")   # ENOSPC mid-write: removed
    (run_dir / ".config-p.yaml.0123456789ab.tmp").write_text("")           # removed
    (run_dir / ".stats-p-2-00000001.json.0123456789ab.tmp").write_text("")  # another producer's: kept
    (shards / ".p-00000001.parquet.0123456789ab.tmp").write_bytes(b"")     # 0-byte hidden shard temp: removed
    (shards / ".p-2-00000001.parquet.0123456789ab.tmp").write_bytes(b"")   # kept
    removed = clean_start(store, "run", "p")
    assert sorted(removed) == sorted([".config-p.yaml.0123456789ab.tmp", ".stats-p-00000001.json.0123456789ab.tmp",
                                      "shards/.p-00000001.parquet.0123456789ab.tmp", "stats-p-00000001.json"])
    left = sorted(p.name for p in run_dir.iterdir())
    assert "stats-p-00000000.json" in left and "stats-p-2-00000001.json" in left and "stats-p.json" in left
    assert (shards / ".p-2-00000001.parquet.0123456789ab.tmp").exists()
    assert store.count("run") == 2 and store.verify("run") == []
    assert clean_start(store, "never-written", "p") == []


def test_clean_start_keeps_the_temp_file_of_a_committed_shard_it_could_not_rename(tmp_path: Path, monkeypatch):
    store = ShardStore(tmp_path)
    monkeypatch.setattr(ShardStore, "_publish", lambda self, tmp, final: None)  # killed after the commit record
    store.commit("run", "p", 0, synthetic_groups(2, group_size=2, seq_len=4, vocab=20, seed=0))
    monkeypatch.setattr(ShardStore, "finish_commits", lambda self, run_id: [])  # its rename fails again
    (staged,) = store.shards_dir("run").glob(".p-00000000.parquet.*.tmp")
    assert clean_start(store, "run", "p") == [] and staged.exists()
    monkeypatch.undo()
    assert ShardStore(tmp_path).verify("run") == []  # a reader finishes the commit from it
