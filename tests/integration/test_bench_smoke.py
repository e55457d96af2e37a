"""Every bench runs at its smoke size: `python -m bench.<name>.run --smoke` exits 0 and prints its table.

Benches are discovered (bench/*/run.py), so a new bench is covered the day it
lands and a renamed helper cannot break one silently. They share one Prefect
server (the session's `prefect_server` fixture, which other integration tests in the
same CI session share too) through PREFECT_API_URL, so none pays for its own
server start; each must finish within BENCH_SMOKE_TIMEOUT_S and leave no
process of its own behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHES = sorted(path.parent.name for path in (REPO / "bench").glob("*/run.py"))
MODULES = [f"bench.{name}.run" for name in BENCHES] + ["bench.serve.drain_rss", "bench.shards.object_store",
                                                       "bench.shards.stats_fold", "bench.datagen.instructions"]
"""Every bench/*/run.py, and the benches that are not a folder's run.py (bench.shards' startup_ab and compact_ab
run at their smoke size in tests/unit/store/test_scale_bench_smoke.py)."""
TIMEOUT_S = float(os.environ.get("BENCH_SMOKE_TIMEOUT_S", "300"))
TABLE_ROW = re.compile(r"^\|.*\|\s*$", re.MULTILINE)

pytestmark = pytest.mark.integration


def test_benches_are_discovered():
    assert {"datagen", "export", "inference", "shards"} <= set(BENCHES)


@pytest.mark.parametrize("module", MODULES)
def test_bench_smoke_run_prints_its_table(module: str, prefect_server: dict[str, str]) -> None:
    env = {**os.environ, **prefect_server, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    bench = subprocess.Popen([sys.executable, "-m", module, "--smoke"], cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = bench.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(bench.pid, signal.SIGKILL)  # the bench and everything it started
        stdout, stderr = bench.communicate()
        pytest.fail(f"{module} --smoke ran past {TIMEOUT_S:.0f}s (or a process it started kept it open):\n"
                    f"{stderr[-3000:]}")
    assert bench.returncode == 0, f"{module} --smoke failed:\n{stderr[-4000:]}"
    assert len(TABLE_ROW.findall(stdout)) >= 2, f"{module} --smoke printed no table:\n{stdout[-2000:]}"
