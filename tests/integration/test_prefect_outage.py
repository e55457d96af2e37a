"""A Prefect API outage mid-run: a run rides it out (clients retry with back-off), a run whose outage outlasts the
configured window fails with one line naming the API's URL, and a run whose process died while the server was down
is marked Crashed within 2 minutes of the server coming back (heartbeats + the zombie automation of factory-local).

Each test runs its own local stack (factory/local_prefect.py), since it stops and restarts the server. CI uses a
short outage (FACTORY_TEST_PREFECT_OUTAGE_S, default 20 s); the 5-minute figure is from
`FACTORY_TEST_PREFECT_OUTAGE_S=300 pytest tests/integration/test_prefect_outage.py -k rides_out` (bench/RESULTS.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from factory.inference.fault_server import FaultServer
from factory.local_prefect import LocalPrefect
from factory.store import ShardStore
from tests.conftest import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
OUTAGE_S = float(os.environ.get("FACTORY_TEST_PREFECT_OUTAGE_S", "20"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    from factory.inference.tiny_model import make_tiny_policy

    return str(make_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny"))


@pytest.fixture
def stack(tmp_path):
    stack = LocalPrefect(home=tmp_path / "factory", port=free_port())
    stack.up(worker=False)
    yield stack
    stack.down()


@pytest.fixture
def model_server():
    server = FaultServer(delay_s=0.3).start()
    yield server
    server.stop()


def start_run(stack: LocalPrefect, tokenizer: str, base_url: str, store: Path, run_id: str, items: int,
              **environ: str) -> subprocess.Popen:
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, **stack.environ(), "PYTHONPATH": os.pathsep.join(paths), **environ}
    args = ["--openai.base_url", base_url, "--env.tokenizer_name", tokenizer, "--env.group_size", "4",
            "--env.max_tokens", "8", "--env.ensure_scores_are_not_same", "false", "--env.total_items", str(items),
            "--datagen.store_root", str(store), "--datagen.run_id", run_id, "--datagen.chunk_items", "4",
            "--datagen.score_workers", "1", "--datagen.chunks_in_flight", "1"]
    return subprocess.Popen([sys.executable, "environments/intern_bootcamp.py", "process", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_commits(process: subprocess.Popen, store: ShardStore, run_id: str, count: int) -> None:
    deadline = time.monotonic() + 240
    while len(store.committed(run_id)) < count:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def pipeline_state(stack: LocalPrefect, run_id: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: stack.api_url}), get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"intern-bootcamp-{run_id}"])))
    return run.state


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def test_a_run_rides_out_a_prefect_outage_and_completes_exactly_once(stack, model_server, tokenizer, tmp_path):
    store = ShardStore(tmp_path / "store")
    process = start_run(stack, tokenizer, model_server.base_url, store.root, "outage", 60)
    try:
        wait_for_commits(process, store, "outage", 1)
        stack.down()
        down_at = time.monotonic()
        time.sleep(OUTAGE_S)
        assert process.poll() is None, process.communicate()[1][-3000:]
        stack.up(worker=False)
        print(f"Prefect server down for {time.monotonic() - down_at:.0f}s")
        out, err = process.communicate(timeout=OUTAGE_S + 600)
    finally:
        stop(process)
    assert process.returncode == 0, err[-3000:]
    assert sorted(r.chunk for r in store.committed("outage").values()) == list(range(15))
    assert store.count("outage") == 60 and store.verify("outage") == []
    assert pipeline_state(stack, "outage").is_completed()


def test_an_outage_past_the_window_fails_with_one_line_naming_the_api(stack, model_server, tokenizer, tmp_path):
    store = ShardStore(tmp_path / "store")
    # 3 retries: 2 + 4 + 8 = 14 s of back-off (FACTORY_PREFECT_OUTAGE_S=14 sets the same)
    process = start_run(stack, tokenizer, model_server.base_url, store.root, "gone", 400,
                        PREFECT_CLIENT_MAX_RETRIES="3")
    try:
        wait_for_commits(process, store, "gone", 1)
        stack.down()
        down_at = time.monotonic()
        out, err = process.communicate(timeout=240)
        took = time.monotonic() - down_at
    finally:
        stop(process)
    print(f"Prefect server gone -> run exited in {took:.0f}s")
    assert process.returncode != 0
    assert last_line(err).startswith(f"error: the Prefect API at {stack.api_url} stopped answering"), err[-3000:]
    # A call in the data path (the task engine reads an upstream task's state) waits out its retries, then the flow
    # engine's final state report waits out its own: about twice the window, plus start-up on a loaded machine.
    assert took < 2 * 14 * 1.2 + 120, took
    assert store.verify("gone") == []


def test_a_run_killed_during_an_outage_is_crashed_within_2_minutes_of_the_server_coming_back(
        stack, model_server, tokenizer, tmp_path):
    store = ShardStore(tmp_path / "store")
    process = start_run(stack, tokenizer, model_server.base_url, store.root, "zombie", 400)
    try:
        wait_for_commits(process, store, "zombie", 1)
        time.sleep(2)  # the flow run reports Running
        stack.down()
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        time.sleep(OUTAGE_S)
        stack.up(worker=False)
        back = time.monotonic()
        assert pipeline_state(stack, "zombie").is_running()
        while not (state := pipeline_state(stack, "zombie")).is_crashed():
            assert time.monotonic() - back < 120, state
            time.sleep(2)
    finally:
        stop(process)
    print(f"dead run marked Crashed {time.monotonic() - back:.0f}s after the server came back")
    assert "no heartbeat" in state.message
