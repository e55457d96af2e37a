"""Compaction on a full disk (a small tmpfs filled to its last pages): one error line, every committed group readable,
and the compaction completes once space is freed."""

from __future__ import annotations

import pytest

from bench.store_faults.probe import Ballast, can_mount_tmpfs, small_tmpfs
from factory.store import ShardStore, StoreError
from factory.store_compact import compact_run
from factory.synthetic import synthetic_groups

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not can_mount_tmpfs(), reason="mounting a tmpfs needs root (CAP_SYS_ADMIN)")]


@pytest.mark.parametrize("copy", ["row_groups", "pages", "decode"])
@pytest.mark.parametrize("slack_pages", [0, 3, 40])
def test_compaction_on_a_full_disk_fails_in_one_line_and_loses_nothing(slack_pages, copy):
    with small_tmpfs(16) as mount:
        store = ShardStore(mount / "store")
        for chunk in range(12):
            store.commit("r", "w0", chunk, synthetic_groups(6, start=6 * chunk, group_size=2, seq_len=64))
        before = [g.group_id for g in store.iter_groups("r")]
        ballast = Ballast(mount / "ballast")
        try:
            ballast.fill(slack_pages)
            try:  # with a few pages left the merged file (smaller than its shards) may fit: then it just works
                compact_run(ShardStore(mount / "store"), "r", target_bytes=1 << 30, method=copy)
            except StoreError as error:
                assert "disk is full" in str(error) and "\n" not in str(error)
            else:
                assert slack_pages > 0
            after = ShardStore(mount / "store")
            assert [g.group_id for g in after.iter_groups("r")] == before
            assert after.verify("r") == []
            ballast.free(8)
            compact_run(after, "r", target_bytes=1 << 30, method=copy)
            fresh = ShardStore(mount / "store")
            assert [g.group_id for g in fresh.iter_groups("r")] == before and fresh.verify("r") == []
            assert len(list((mount / "store" / "r" / "shards").glob("*.parquet"))) == 1
        finally:
            ballast.close()
