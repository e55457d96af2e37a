"""Every bench runs at its smoke size: `python -m bench.<name>.run --smoke` exits 0 and prints its table.

Benches are discovered (bench/*/run.py), so a new bench is covered the day it
lands and a renamed helper cannot break one silently. They share one Prefect
server (started here without a work pool) through PREFECT_API_URL, so none pays for its own
server start; each must finish within BENCH_SMOKE_TIMEOUT_S and leave no
process of its own behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
BENCHES = sorted(path.parent.name for path in (REPO / "bench").glob("*/run.py"))
TIMEOUT_S = float(os.environ.get("BENCH_SMOKE_TIMEOUT_S", "300"))
TABLE_ROW = re.compile(r"^\|.*\|\s*$", re.MULTILINE)

pytestmark = pytest.mark.integration


def test_benches_are_discovered():
    assert {"datagen", "export", "inference", "shards"} <= set(BENCHES)


@pytest.fixture(scope="module")
def bench_prefect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A bare Prefect API server for the benches' flows (no work pool: benches call flows in-process)."""
    from factory.local_prefect import LocalPrefect

    stack = LocalPrefect(home=tmp_path_factory.mktemp("bench-prefect"), port=free_port())
    env = {**os.environ, **stack.environ()}
    (stack.home / "prefect").mkdir(parents=True, exist_ok=True)
    with open(stack.home / "server.log", "ab") as log:
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start"], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not stack.healthy():
            assert server.poll() is None, f"the Prefect server exited; see {stack.home / 'server.log'}"
            assert time.monotonic() < deadline, "the Prefect server did not come up within 180 s"
            time.sleep(0.5)
        yield stack.environ()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.mark.parametrize("name", BENCHES)
def test_bench_smoke_run_prints_its_table(name: str, bench_prefect: dict[str, str]) -> None:
    env = {**os.environ, **bench_prefect, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    try:
        done = subprocess.run([sys.executable, "-m", f"bench.{name}.run", "--smoke"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"bench.{name}.run --smoke ran past {TIMEOUT_S:.0f}s (or a process it started kept it open):\n"
                    f"{(error.stderr or b'')[-3000:]!r}")
    assert done.returncode == 0, f"bench.{name}.run --smoke failed:\n{done.stderr[-4000:]}"
    assert len(TABLE_ROW.findall(done.stdout)) >= 2, f"bench.{name}.run --smoke printed no table:\n{done.stdout[-2000:]}"
