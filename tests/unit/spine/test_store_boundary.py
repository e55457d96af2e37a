"""The boundary-fill probe as a test: a few dozen cycles of a disk full to its last bytes, then a rerun each time
(the full 1,000 cycles: `python -m bench.store_faults.probe`, results in bench/RESULTS.md)."""

from __future__ import annotations

import pytest

from bench.store_faults.probe import Ballast, can_mount_tmpfs, ok, probe_store, small_tmpfs


def test_store_commits_under_a_byte_quota_lose_and_double_nothing(tmp_path):
    result = probe_store(tmp_path, 40, quota=True, seed=1)
    assert result["failed_commits"], "the quota never cut a commit short: the probe tested nothing"
    assert ok(result), result
    assert result["acknowledged"] == result["stored"] == 40 * 3


needs_tmpfs = pytest.mark.skipif(not can_mount_tmpfs(), reason="mounting a tmpfs needs root (CAP_SYS_ADMIN)")


@needs_tmpfs
def test_store_commits_on_a_full_tmpfs_lose_and_double_nothing():
    with small_tmpfs(8) as mount:
        ballast = Ballast(mount / "ballast")
        try:
            result = probe_store(mount / "store", 60, quota=False, seed=2, ballast=ballast)
        finally:
            ballast.close()
    assert result["failed_commits"] and ok(result), result
