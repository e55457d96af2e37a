"""run-api on a tmpfs filled to its last pages, SIGKILLed every few cycles: each acknowledged group is stored and
served exactly once, every failure is a 503 with Retry-After (the full 1,000 cycles: bench/RESULTS.md)."""

from __future__ import annotations

import pytest

from bench.store_faults.probe import Ballast, can_mount_tmpfs, ok, probe_api, small_tmpfs

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not can_mount_tmpfs(), reason="mounting a tmpfs needs root (CAP_SYS_ADMIN)")]


def test_run_api_on_a_full_tmpfs_acknowledges_stores_and_serves_each_group_once():
    with small_tmpfs(16) as mount:
        ballast = Ballast(mount / "ballast")
        try:
            result = probe_api(mount, 12, ballast, seed=3, restart_every=5)
        finally:
            ballast.close()
    assert result["posts"].get("503"), "no post met a full disk: the probe tested nothing"
    assert ok(result), result
