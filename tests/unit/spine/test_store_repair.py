"""`verify` finds every inconsistency a torn log or a full disk leaves; `repair` fixes what it can, losing nothing."""

from __future__ import annotations

import os

import polars as pl
import pyarrow.parquet as pq

from factory.store import ShardStore
from factory.store_cli import main as store_cli
from factory.store_repair import repair
from factory.synthetic import synthetic_groups


def groups(count: int, start: int = 0) -> list:
    return list(synthetic_groups(count, start=start, group_size=2, seq_len=8))


def globbed(store: ShardStore, run_id: str = "run") -> list[str]:
    pattern = str(store.shards_dir(run_id) / "*.parquet")
    return sorted(pl.scan_parquet(pattern).select("group_id").collect()["group_id"].to_list())


def test_logs_written_before_checked_lines_are_still_read(store_root):
    store = ShardStore(store_root)
    store.commit("run", "w0", 0, groups(3))
    store.commit("run", "w0", 1, groups(2, start=3))
    log = store.commit_log("run")
    records = list(store.committed("run").values())
    log.write_text("".join(record.to_json() + "\n" for record in records))  # the format before checks
    fresh = ShardStore(store_root)
    assert fresh.count("run") == 5 and fresh.verify("run") == []
    fresh.commit("run", "w0", 2, groups(1, start=5))  # new checked lines append to an old log
    assert ShardStore(store_root).count("run") == 6 and ShardStore(store_root).verify("run") == []


def old_damage(store: ShardStore) -> dict[str, str]:
    """The state the old store left after ENOSPC during appends, plus a lost shard and duplicated groups."""
    store.commit("run", "w0", 0, groups(3))
    store.commit("run", "w0", 1, groups(3, start=3))
    store.commit("run", "w0", 2, groups(3, start=6))
    store.commit("run", "w0", 3, groups(2, start=3))  # ids 3 and 4 again: a retry stored twice
    log = store.commit_log("run")
    lines = log.read_bytes().splitlines(keepends=True)
    chunk1 = store.committed("run")["w0-00000001.parquet"]
    # The old commit: shard renamed into place, then ENOSPC mid-append (a torn fragment), then the next commit's
    # record appended onto the fragment.
    fragment = chunk1.to_json().encode()[:57]
    log.write_bytes(lines[0] + fragment + lines[1] + lines[2] + lines[3])
    shards = store.shards_dir("run")
    pq.write_table(pq.read_table(shards / "w0-00000000.parquet"), shards / "w0-00000009.parquet")  # unlogged
    os.unlink(shards / "w0-00000002.parquet")  # logged, then lost
    stale = shards / ".w0-00000010.parquet.abc.tmp"
    stale.write_bytes(b"half a shard")
    return {"stale": str(stale)}


def test_verify_reports_torn_lines_unlogged_missing_and_duplicates(store_root):
    store = ShardStore(store_root)
    old_damage(store)
    with open(store.commit_log("run"), "ab") as log:
        log.write(b'{"bytes": 12, "chunk": 4, "comm')  # a torn last line
    fresh = ShardStore(store_root)
    # The record merged onto the fragment is read (its groups were acknowledged); the fragment is not.
    assert set(fresh.committed("run")) == {f"w0-0000000{i}.parquet" for i in range(4)}
    problems = fresh.verify("run")
    kinds = sorted(p.kind for p in problems)
    assert kinds == ["bad-line", "duplicate", "missing", "torn-line", "unlogged"], problems
    by_kind = {p.kind: p for p in problems}
    assert by_kind["bad-line"].path.endswith("commits.jsonl:2") and "was kept" in by_kind["bad-line"].reason
    assert by_kind["unlogged"].path.endswith("w0-00000009.parquet")
    assert by_kind["missing"].path.endswith("w0-00000002.parquet")
    assert "2 group ids are also stored in w0-00000001.parquet" in by_kind["duplicate"].reason


def test_repair_fixes_what_it_can_and_loses_no_committed_group(store_root):
    store = ShardStore(store_root)
    paths = old_damage(store)
    committed_before = {g.group_id for g in ShardStore(store_root).iter_groups("run")}
    report = repair(ShardStore(store_root), "run", stale_tmp_s=0)
    assert any("kept the record of w0-00000001.parquet" in a for a in report.actions)
    assert any("moved unlogged shard w0-00000009.parquet" in a for a in report.actions)
    assert any(paths["stale"] in a for a in report.actions)
    assert any("rewrote w0-00000003.parquet without 2 group ids stored earlier" in a for a in report.actions)
    assert sorted(p.kind for p in report.remaining) == ["missing"]  # reported, not fixable here
    after = ShardStore(store_root)
    ids = [g.group_id for g in after.iter_groups("run")]
    assert set(ids) == committed_before and len(ids) == len(set(ids))  # each committed group exactly once
    assert globbed(after) == sorted(ids)  # the unlogged shard is out of the glob
    assert (after.run_dir("run") / "unlogged" / "w0-00000009.parquet").exists()
    assert (after.run_dir("run") / "commits.jsonl.damaged").read_bytes().startswith(b'{"bytes"')
    assert not os.path.exists(paths["stale"])
    assert repair(after, "run").actions == []  # a second repair has nothing to do


def test_store_cli_verify_and_repair(store_root, capsys):
    store = ShardStore(store_root)
    store.commit("ok", "w0", 0, groups(2))
    assert store_cli(["verify", str(store_root)]) == 0
    assert "ok: 1 committed shards, 2 groups, consistent" in capsys.readouterr().out
    old_damage(store)
    assert store_cli(["verify", str(store_root), "run"]) == 1
    out = capsys.readouterr().out
    assert "run: unlogged:" in out and "run: missing:" in out
    assert store_cli(["repair", str(store_root), "run"]) == 1  # the lost shard remains
    out = capsys.readouterr().out
    assert "run: repaired: moved unlogged shard" in out and "1 problems" in out
